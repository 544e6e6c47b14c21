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


def write(path: str | Path, header: KvBlocksHeader, blocks: Iterable[bytes | memoryview]) -> None:
    """Write atomically: a reader sees the whole file or none."""
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    head = encode_header(header)
    written = 0
    with open(tmp, "wb") as f:
        f.write(MAGIC + _LEN.pack(len(head)) + head)
        for block in blocks:
            if len(block) != header.block_bytes:
                raise BadBlockFile(f"block {written} is {len(block)} bytes, not {header.block_bytes}")
            f.write(block)
            written += 1
    if written != header.num_blocks:
        os.unlink(tmp)
        raise BadBlockFile(f"{written} blocks written, the header says {header.num_blocks}")
    os.replace(tmp, path)


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
