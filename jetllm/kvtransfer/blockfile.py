"""The block file: a prompt's full KV blocks as one engine wrote them, for another to load.

Layout: MAGIC, the header's length (u32 little-endian), the header (msgpack `KvBlocksHeader`),
then the blocks in order, each `block_bytes` long. Block-major, so a block is one contiguous
range: it can be checksummed, chunked and sent on its own.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec

from ..schemas.disagg import Checksum, KvBlocksHeader

MAGIC = b"JLKV\x01\x00"
_LEN = struct.Struct("<I")
MAX_HEADER = 1 << 20


class BadBlockFile(ValueError):
    pass


def prompt_digest(token_ids: Iterable[int]) -> str:
    data = b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids)
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def checksum(block: bytes | bytearray | memoryview, algorithm: Checksum = "sha256-128") -> str:
    """The block's checksum by `algorithm` (schemas/disagg.py: Checksum), 128 bits in hex."""
    return checksummer(algorithm)(block)


def checksummer(algorithm: str) -> Callable[[bytes | bytearray | memoryview], str]:
    """The function for `algorithm`; raises BadBlockFile for one this process cannot compute."""
    if algorithm == "sha256-128":
        return _sha256
    if algorithm == "blake3-128":
        if _blake3 is None:
            raise BadBlockFile("blake3 checksums need the blake3 package (vLLM installs it)")
        return _blake3
    raise BadBlockFile(f"unknown checksum algorithm {algorithm!r} (known: sha256-128, blake3-128)")


def preferred_checksum() -> Checksum:
    """What a decode worker asks for: blake3, which vLLM installs, else sha256."""
    return "blake3-128" if _blake3 is not None else "sha256-128"


def _sha256(block: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(block).hexdigest()[:32]


def _load_blake3() -> Callable[[bytes | bytearray | memoryview], str] | None:
    try:
        from blake3 import blake3
    except ImportError:
        return None

    def digest(block: bytes | bytearray | memoryview) -> str:
        return str(blake3(block).hexdigest(16))

    return digest


_blake3 = _load_blake3()


class BlockSums:
    """Every block's checksum from the blocks' bytes fed in order, however they are cut into
    pieces: taken where the bytes already are (the publishing loop, the receiving callback), since
    a thread that took them block by block paid a GIL handoff per block, which cost a transfer more
    than the hashing itself (docs/decisions.md, "... checksums where the bytes are")."""

    def __init__(self, algorithm: str, block_bytes: int, num_blocks: int) -> None:
        self._digest = checksummer(algorithm)
        self._new, self._hex = _streaming(algorithm)
        self._bb = block_bytes
        self._n = num_blocks
        self._part: Any = None
        """The hash of a block that came in pieces, so far (it holds no reference to them)."""
        self._have = 0
        self.digests: list[str] = []

    @property
    def complete(self) -> bool:
        return len(self.digests) == self._n and not self._have

    def feed(self, data: bytes | memoryview) -> bool:
        """Take the next bytes; False when they run past the last block (nothing of them is taken)."""
        view = memoryview(data)
        if self._have + len(view) > (self._n - len(self.digests)) * self._bb:
            return False
        pos = 0
        while pos < len(view):
            take = min(self._bb - self._have, len(view) - pos)
            if take == self._bb:
                self.digests.append(self._digest(view[pos : pos + take]))
            else:
                if not self._have:
                    self._part = self._new()
                self._part.update(view[pos : pos + take])
                self._have += take
                if self._have == self._bb:
                    self.digests.append(self._hex(self._part))
                    self._part, self._have = None, 0
            pos += take
        return True


def _streaming(algorithm: str) -> tuple[Callable[[], Any], Callable[[Any], str]]:
    """A new hash object for `algorithm`, and how its checksum is read (as `checksummer`'s)."""
    if algorithm == "sha256-128":
        return hashlib.sha256, lambda h: str(h.hexdigest()[:32])
    from blake3 import blake3  # checksummer: installed

    return blake3, lambda h: str(h.hexdigest(16))


def encode_header(header: KvBlocksHeader) -> bytes:
    return msgspec.msgpack.encode(header)


def decode_header(data: bytes) -> KvBlocksHeader:
    try:
        header = msgspec.msgpack.decode(data, type=KvBlocksHeader)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadBlockFile(f"block header does not decode: {exc}") from None
    if header.num_blocks < 0 or header.block_bytes < 0 or header.block_size <= 0:
        raise BadBlockFile("block header has a negative size")
    if header.num_tokens != header.num_blocks * header.block_size:
        raise BadBlockFile(
            f"block header covers {header.num_tokens} tokens, not {header.num_blocks} x {header.block_size}"
        )
    return header


def write(
    path: str | Path,
    header: KvBlocksHeader,
    blocks: Iterable[bytes | memoryview],
    checksum: str | None = None,
) -> None:
    """Write atomically: a reader sees the whole file or none. With `checksum`, every block's
    checksum is taken as it is written (the bytes are in cache then) and kept beside the file
    (`read_sums`), so the publisher need not read the blocks twice."""
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    head = encode_header(header)
    digest = checksummer(checksum) if checksum is not None else None
    sums: list[str] = []
    written = 0
    with open(tmp, "wb") as f:
        f.write(MAGIC + _LEN.pack(len(head)) + head)
        for block in blocks:
            if len(block) != header.block_bytes:
                raise BadBlockFile(f"block {written} is {len(block)} bytes, not {header.block_bytes}")
            if digest is not None:
                sums.append(digest(block))
            f.write(block)
            written += 1
    if written != header.num_blocks:
        os.unlink(tmp)
        raise BadBlockFile(f"{written} blocks written, the header says {header.num_blocks}")
    if checksum is not None:
        sums_path(path).write_bytes(msgspec.msgpack.encode([checksum, sums]))
    os.replace(tmp, path)


def sums_path(path: Path) -> Path:
    return path.with_name(path.name + ".sums")


def read_sums(path: Path, algorithm: str, num_blocks: int) -> list[str] | None:
    """The checksums `write` kept for the block file at `path`, if it took them by `algorithm`."""
    try:
        kept, sums = msgspec.msgpack.decode(sums_path(path).read_bytes(), type=tuple[str, list[str]])
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    return sums if kept == algorithm and len(sums) == num_blocks else None


def remove(path: Path) -> None:
    """The block file and the checksums kept beside it."""
    path.unlink(missing_ok=True)
    sums_path(path).unlink(missing_ok=True)


def read_header(path: str | Path) -> tuple[KvBlocksHeader, int]:
    """The header and where the blocks start; raises BadBlockFile (or OSError)."""
    with open(path, "rb") as f:
        start = f.read(len(MAGIC) + _LEN.size)
        if len(start) < len(MAGIC) + _LEN.size or not start.startswith(MAGIC):
            raise BadBlockFile(f"{Path(path).name} is not a block file")
        (n,) = _LEN.unpack(start[len(MAGIC) :])
        if n > MAX_HEADER:
            raise BadBlockFile(f"block header of {n} bytes is larger than {MAX_HEADER}")
        header = decode_header(f.read(n))
        offset = len(start) + n
        f.seek(0, os.SEEK_END)
        if f.tell() != offset + header.num_blocks * header.block_bytes:
            raise BadBlockFile(
                f"{Path(path).name} holds {f.tell() - offset} bytes of blocks, "
                f"not {header.num_blocks} x {header.block_bytes}"
            )
    return header, offset
