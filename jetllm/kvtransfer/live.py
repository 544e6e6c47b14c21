"""A transfer's blocks checked and written while they arrive, so that little is left to do when
the prefill worker's answer comes.

The decode worker's subscription hands every message to a thread that rebuilds the blocks, takes
each one's checksum (as the header says) and appends it to a block file beside the one the engine will load (hashlib
and file writes release the GIL, so the event loop keeps receiving meanwhile). When the answer
comes, its checksums are compared with the ones taken here and the file is renamed into place.
Whatever does not fit (an unexpected chunk size, a header that does not decode, a short block)
just leaves no live file: the caller then assembles the messages as before, or reads the store.
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

from ..schemas.disagg import KvBlocksHeader
from . import blockfile
from .chunking import blocks, blocks_per_message, chunks_per_block, message_count


class LiveFile(threading.Thread):
    """Writes `dest` + ".live" from the messages `put` in order; `None` ends it early."""

    def __init__(self, dest: Path, chunk: int, packed: bool) -> None:
        super().__init__(name=f"kv-live-{dest.name}", daemon=True)
        self.dest = dest
        self.tmp = dest.with_name(dest.name + ".live")
        self.chunk = chunk
        self.packed = packed
        self.per_message = 1
        self.header: KvBlocksHeader | None = None
        self.digests: list[str] = []
        self.complete = False
        self._q: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._ended = False

    def put(self, data: bytes | None) -> None:
        self._q.put(data)

    def stop(self) -> None:
        self._ended = True
        self._q.put(None)

    def run(self) -> None:
        try:
            self._write()
        except Exception:  # no live file: the caller assembles or reads the store
            self.complete = False
        if not self.complete:
            self.tmp.unlink(missing_ok=True)

    def _write(self) -> None:
        first = self._q.get()
        if first is None:
            return
        header = blockfile.decode_header(first)
        checksum = blockfile.checksummer(header.checksum)
        n, bb = header.num_blocks, header.block_bytes
        self.per_message = blocks_per_message(bb, self.chunk, self.packed)
        count = message_count(n, bb, self.chunk, self.per_message) - 1 if bb else 0
        with open(self.tmp, "wb") as f:
            f.write(blockfile.MAGIC + len(first).to_bytes(4, "little") + first)
            group = 1 if self.per_message > 1 else chunks_per_block(bb, self.chunk)
            got: list[bytes] = []
            for _ in range(count):
                part = self._q.get()
                if part is None or self._ended:
                    return
                got.append(part)
                if len(got) == group:
                    want = min(self.per_message, n - len(self.digests))
                    for block in blocks(got, want, bb, self.chunk, self.per_message):
                        self.digests.append(checksum(block))
                        f.write(block)
                    got = []
            if len(self.digests) != n:
                return
        self.header = header
        self.complete = True

    def install(self, header: KvBlocksHeader, checksums: list[str], chunk: int, per_message: int) -> bool:
        """Whether the finished file holds exactly these blocks; if so it becomes `dest`."""
        same = (chunk, per_message, header) == (self.chunk, self.per_message, self.header)
        if not self.complete or not same or checksums != self.digests:
            self.tmp.unlink(missing_ok=True)
            return False
        os.replace(self.tmp, self.dest)
        return True
