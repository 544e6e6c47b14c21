"""A transfer's blocks checked and written while they arrive, so that little is left to do when
the prefill worker's answer comes.

The decode worker's subscription hands every message to `put`, in order: the blocks' checksums
are taken there, on the event loop (blockfile.BlockSums: blake3 takes ~0.2 ms per MiB here), and
the bytes go to a thread that appends them to a block file beside the one the engine will load
(one write per message, which releases the GIL). When the answer comes, its checksums are compared
with the ones taken here and the file is renamed into place. Whatever does not fit (a header that
does not decode, bytes past the last block, a failed write) just leaves no live file: the caller
then assembles the messages as before, or reads the store.
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

from ..schemas.disagg import KvBlocksHeader
from . import blockfile


class LiveFile:
    """Writes `dest` + ".live" from the messages `put` in order."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.tmp = dest.with_name(dest.name + ".live")
        self.header: KvBlocksHeader | None = None
        self._sums: blockfile.BlockSums | None = None
        self._broken = False
        self._written = False
        self._q: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name=f"kv-live-{dest.name}", daemon=True)

    def start(self) -> None:
        self._writer.start()

    def put(self, data: bytes) -> None:
        """The transfer's next message (the header first)."""
        if self._broken:
            return
        try:
            if self.header is None:
                header = blockfile.decode_header(data)
                self._sums = blockfile.BlockSums(header.checksum, header.block_bytes, header.num_blocks)
                self.header = header
                self._q.put(blockfile.MAGIC + len(data).to_bytes(4, "little") + data)
            elif self._sums is not None and self._sums.feed(data):
                self._q.put(data)
            else:
                self.stop()
        except blockfile.BadBlockFile:
            self.stop()

    def finish(self) -> None:
        """Every message is in: the writer ends once it has written them."""
        self._q.put(None)

    def stop(self) -> None:
        """No live file after all: the writer drops what it holds."""
        self._broken = True
        self._q.put(None)

    def join(self) -> None:
        self._writer.join()

    def _write(self) -> None:
        try:
            with open(self.tmp, "wb") as f:
                while (data := self._q.get()) is not None:
                    if self._broken:
                        break
                    f.write(data)
            self._written = not self._broken
        except OSError:  # no live file: the caller assembles or reads the store
            self._written = False
        if not self._written:
            self.tmp.unlink(missing_ok=True)

    def install(self, header: KvBlocksHeader, checksums: list[str]) -> bool:
        """Whether the finished file holds exactly these blocks; if so it becomes `dest`.
        Call after `finish` and `join`."""
        sums = self._sums
        same = sums is not None and sums.complete and sums.digests == checksums
        if not (self._written and header == self.header and same):
            self.tmp.unlink(missing_ok=True)
            return False
        os.replace(self.tmp, self.dest)
        return True
