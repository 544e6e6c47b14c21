"""A block file carried over NATS: published by the prefill worker, fetched and checked by the
decode worker, removed once loaded (the stream's TTL removes what nobody fetched).

On the subject `Names.kv_blocks(transfer_id)` go the header, then every block in order, each cut
into chunks that fit the server's max payload (the chunk sizes follow from the header, so the
chunks carry no headers of their own). The header and the last chunk are published with a
JetStream ack: once the last one is acked, the server has stored every message before it, since
one connection's messages are handled in order; a store that is full refuses them, loudly.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
from nats.aio.client import Client as NATS

from ..schemas.disagg import KvBlocksHeader, Prefilled
from ..subjects.codec import HEADER_MARGIN
from ..subjects.names import Names
from . import blockfile


class TransferFailed(Exception):
    """The blocks cannot be used; the message says why (the decode worker then prefills itself)."""


class Published(msgspec.Struct, kw_only=True):
    header: KvBlocksHeader
    checksums: list[str]
    chunk_bytes: int
    messages: int
    bytes: int


def chunk_size(max_payload: int) -> int:
    return max(4096, max_payload - HEADER_MARGIN)


def chunks(view: memoryview, block_bytes: int, num_blocks: int, chunk: int) -> Iterator[memoryview]:
    for j in range(num_blocks):
        base = j * block_bytes
        for off in range(0, block_bytes, chunk):
            yield view[base + off : base + min(off + chunk, block_bytes)]


def chunks_per_block(block_bytes: int, chunk: int) -> int:
    return max(1, -(-block_bytes // chunk))


def _read(path: Path) -> tuple[KvBlocksHeader, memoryview, list[str]]:
    header, offset = blockfile.read_header(path)
    data = memoryview(path.read_bytes())[offset:]
    bb = header.block_bytes
    return header, data, [blockfile.checksum(data[j * bb : (j + 1) * bb]) for j in range(header.num_blocks)]


async def publish_blocks(nc: NATS, names: Names, transfer_id: str, path: Path) -> Published:
    """Publish the block file at `path`; raises TransferFailed when the store refuses it."""
    header, data, sums = await anyio.to_thread.run_sync(_read, path)
    subject = names.kv_blocks(transfer_id)
    js = nc.jetstream()
    chunk = chunk_size(nc.max_payload)
    pieces = list(chunks(data, header.block_bytes, header.num_blocks, chunk))
    try:
        await js.publish(subject, blockfile.encode_header(header), timeout=5)
        for piece in pieces[:-1]:
            await nc.publish(subject, bytes(piece))
        if pieces:
            await js.publish(subject, bytes(pieces[-1]), timeout=10)
    except Exception as exc:
        raise TransferFailed(f"the block store refused the blocks: {type(exc).__name__}: {exc}") from None
    return Published(
        header=header, checksums=sums, chunk_bytes=chunk, messages=1 + len(pieces), bytes=len(data)
    )


async def fetch_blocks(nc: NATS, names: Names, done: Prefilled, dest: Path, *, timeout: float) -> None:
    """Fetch the blocks `done` announces into the block file `dest`, checking each block against
    its checksum; raises TransferFailed naming what is missing, late or wrong."""
    header = done.header
    n, bb = header.num_blocks, header.block_bytes
    if len(done.checksums) != n or done.chunk_bytes <= 0:
        raise TransferFailed(f"the handoff names {len(done.checksums)} checksums for {n} blocks")
    per_block = chunks_per_block(bb, done.chunk_bytes) if bb else 0
    if done.messages != 1 + n * per_block:
        raise TransferFailed(
            f"the handoff says {done.messages} messages, its header means {1 + n * per_block}"
        )
    if done.expires_at < time.time():
        raise TransferFailed("the blocks expired before they were fetched")
    js = nc.jetstream()
    sub = await js.subscribe(
        names.kv_blocks(done.transfer_id), stream=names.kv_blocks_stream, ordered_consumer=True
    )
    tmp = dest.with_name(dest.name + ".part")
    got = 0
    try:
        with anyio.fail_after(timeout), open(tmp, "wb") as f:
            msgs = sub.messages
            first = await msgs.__anext__()
            try:
                sent = blockfile.decode_header(first.data)
            except blockfile.BadBlockFile as exc:
                raise TransferFailed(str(exc)) from None
            if sent != header:
                raise TransferFailed("the stored block header differs from the handoff's")
            head = blockfile.encode_header(header)
            f.write(blockfile.MAGIC + len(head).to_bytes(4, "little") + head)
            block = bytearray()
            for j in range(n):
                block.clear()
                for _ in range(per_block):
                    block += (await msgs.__anext__()).data
                if len(block) != bb or blockfile.checksum(block) != done.checksums[j]:
                    raise TransferFailed(f"block {j + 1} of {n} fails its checksum")
                f.write(block)
                got += 1
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, TimeoutError):
            raise TransferFailed(f"only {got} of {n} blocks arrived within {timeout:.1f}s") from None
        raise
    finally:
        try:
            await sub.unsubscribe()
        except Exception:
            pass
    os.replace(tmp, dest)


async def remove_blocks(nc: NATS, names: Names, transfer_id: str) -> None:
    await nc.jetstream().purge_stream(names.kv_blocks_stream, subject=names.kv_blocks(transfer_id))
