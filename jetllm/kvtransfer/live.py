"""A transfer's blocks checked and written while they arrive, so that little is left to do when
the prefill worker's answer comes.

The decode worker's subscription hands every message to `put`, in order, on the event loop: the
blocks' checksums are taken there (blockfile.BlockSums; blake3 takes ~0.2 ms per MiB here) and
the bytes appended to a block file beside the one the engine will load, one write per message (a
copy into the page cache: ~0.25 ms per MiB here). Threads did this before and cost the transfer
more than the work itself: on two cores every handoff of the GIL between them and the event loop
waited (docs/decisions.md, "KV blocks straight to the decode worker by default; checksums where
the bytes are"). No message is kept once written. When the answer comes, its checksums are
compared with the ones taken here and the file is renamed into place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

from ..schemas.disagg import KvBlocksHeader
from . import blockfile


class LiveFile:
    """Writes `dest` + ".live" from the messages `put` in order."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.tmp = dest.with_name(dest.name + ".live")
        self.header: KvBlocksHeader | None = None
        self._sums: blockfile.BlockSums | None = None
        self._file: BinaryIO | None = None
        self._broken: str | None = None

    def put(self, data: bytes) -> None:
        """The transfer's next message (the header first)."""
        if self._broken is not None:
            return
        try:
            if self._sums is None:
                header = blockfile.decode_header(data)
                self._sums = blockfile.BlockSums(header.checksum, header.block_bytes, header.num_blocks)
                self.header = header
                self._file = open(self.tmp, "wb")  # noqa: SIM115  # closed by install or close
                self._file.write(blockfile.MAGIC + len(data).to_bytes(4, "little") + data)
            elif self._sums.complete:
                return  # past the last block: not this transfer's
            elif self._sums.feed(data) and self._file is not None:
                self._file.write(data)
            else:
                self._fail("a message runs past the last block of the header received")
        except blockfile.BadBlockFile as exc:
            self._fail(str(exc))
        except OSError as exc:
            self._fail(f"the block file cannot be written: {exc}")

    def problem(self, header: KvBlocksHeader, checksums: list[str]) -> str | None:
        """Why the file received is not the blocks the answer announces; None: it is."""
        sums = self._sums
        if self._broken is not None:
            return self._broken
        if sums is None or header != self.header:
            return "the block header received differs from the handoff's"
        for j, (got, want) in enumerate(zip(sums.digests, checksums, strict=False)):
            if got != want:
                return f"block {j + 1} of {header.num_blocks} fails its checksum"
        if not sums.complete:
            return f"only {len(sums.digests)} of {header.num_blocks} blocks arrived"
        return None

    def install(self, header: KvBlocksHeader, checksums: list[str]) -> str | None:
        """Make the file `dest` if it holds exactly these blocks; else remove it and say why."""
        problem = self.problem(header, checksums)
        if problem is not None or self._file is None:
            self.close()
            return problem or "the block file was closed"
        self._file.close()
        self._file = None
        os.replace(self.tmp, self.dest)
        return None

    def close(self) -> None:
        """Drop the file unless it was installed."""
        if self._file is not None:
            self._file.close()
            self._file = None
            self.tmp.unlink(missing_ok=True)

    def _fail(self, why: str) -> None:
        self._broken = why
        self.close()
