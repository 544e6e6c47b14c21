"""A block file carried over NATS: published by the prefill worker, received and checked by the
decode worker as it comes.

On the transfer's subject go the header, then every block in order, cut into chunks that fit the
server's max payload or packed several to a message (chunking.py; the chunk sizes follow from the
header and the answer, so the chunks carry no headers of their own). By default the subject is
`Names.kv_live(transfer_id)`, which no stream holds: only the decode worker's subscription gets
the blocks. When the decode worker asks for the store (`PrefillRequest.stored`), it is
`Names.kv_blocks(transfer_id)`, and the header and the last chunk are published with a JetStream
ack: once the last one is acked, the server has stored every message before it, since one
connection's messages are handled in order; a store that is full refuses them, loudly. The decode
worker reads back what its subscription missed and removes the blocks once loaded (the stream's
TTL removes what nobody fetched). When the decode worker asks for it, its receipts on
`Names.kv_received(transfer_id)` pace the publishing (pacing.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import anyio
import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from ..schemas.disagg import Checksum, KvBlocksHeader, Prefilled
from ..subjects.names import Names
from . import blockfile
from .chunking import (  # noqa: F401  # chunks_per_block: imported from here too
    blocks,
    blocks_per_message,
    chunk_size,
    chunks,
    chunks_per_block,
    message_count,
)
from .live import LiveFile
from .pacing import Pacing, Receiving
from .window import WINDOW_BYTES


class TransferFailed(Exception):
    """The blocks cannot be used; the message says why (the decode worker then prefills itself)."""


class Published(msgspec.Struct, kw_only=True):
    header: KvBlocksHeader
    checksums: list[str]
    chunk_bytes: int
    blocks_per_message: int
    messages: int
    bytes: int


def _map(path: Path, checksum: Checksum) -> tuple[KvBlocksHeader, mmap.mmap, int, list[str] | None]:
    """The file mapped, not read: publishing starts at once and its chunks are never copied here;
    and the checksums kept beside it, if taken by `checksum`."""
    header, offset = blockfile.read_header(path)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return header, mapped, offset, blockfile.read_sums(path, checksum, header.num_blocks)


async def publish_blocks(
    nc: NATS,
    names: Names,
    transfer_id: str,
    path: Path,
    *,
    packed: bool = False,
    checksum: Checksum = "sha256-128",
    window: int = 0,
    stored: bool = True,
) -> Published:
    """Publish the block file at `path` (its checksums, by `checksum`: the ones the engine's
    connector kept as it wrote the file, else taken piece by piece as it goes), several blocks to
    a message if `packed`, at most `window` bytes ahead of the decode worker's receipts, to the
    block stream if `stored`, else straight to the decode worker; raises TransferFailed when the
    store refuses it or the receipts stop."""
    try:
        blockfile.checksummer(checksum)
    except blockfile.BadBlockFile as exc:
        raise TransferFailed(str(exc)) from None
    header, mapped, offset, kept = await anyio.to_thread.run_sync(_map, path, checksum)
    header = msgspec.structs.replace(header, checksum=checksum)
    data = memoryview(mapped)[offset:]
    size = len(data)
    subject = names.kv_blocks(transfer_id) if stored else names.kv_live(transfer_id)
    js = nc.jetstream()
    chunk = chunk_size(nc.max_payload)
    per_message = blocks_per_message(header.block_bytes, chunk, packed)
    pieces = list(chunks(data, header.block_bytes, header.num_blocks, chunk, per_message))
    messages = 1 + len(pieces)
    sums = blockfile.BlockSums(checksum, header.block_bytes, header.num_blocks)
    paced = Pacing(window)
    stalled = False
    try:
        if window > 0:
            paced.sub = await nc.subscribe(names.kv_received(transfer_id), cb=paced.on_receipt)
        head = blockfile.encode_header(header)
        paced.window.sending(len(head))
        if stored:
            await js.publish(subject, head, timeout=5)
        else:
            await nc.publish(subject, head)
        for i, piece in enumerate(pieces):
            if not await paced.wait():
                stalled = True
                break
            if kept is None:
                sums.feed(piece)
            paced.window.sending(len(piece))
            if i < len(pieces) - 1 or not stored:
                await nc.publish(subject, piece)  # type: ignore[arg-type]  # any bytes-like will do
            else:
                await js.publish(subject, bytes(piece), timeout=10)
    except Exception as exc:
        raise TransferFailed(f"the block store refused the blocks: {type(exc).__name__}: {exc}") from None
    finally:
        await paced.close()
        pieces.clear()
        data.release()
        with contextlib.suppress(BufferError):  # a chunk still referenced: unmapped when it goes
            mapped.close()
    if stalled:
        raise TransferFailed(paced.stall_message())
    return Published(
        header=header,
        checksums=kept if kept is not None else sums.digests,
        chunk_bytes=chunk,
        blocks_per_message=per_message,
        messages=messages,
        bytes=size,
    )


class Incoming:
    """A transfer's messages as they are published: a plain subscription the decode worker opens
    before it sends the prefill job. Usually every block is here when the answer comes, and nothing
    is read back from the store, which is there (if the decode worker asked for it) for what this
    copy missed or got wrong. Given the block file it will fetch into, it checks and writes the
    blocks as they come (live.py) and keeps none of them."""

    def __init__(self, max_bytes: int) -> None:
        self.count = 0
        """Messages received (up to `max_bytes`)."""
        self.messages: list[bytes] = []
        """The messages themselves, kept only when no live file takes them."""
        self.max_bytes = max_bytes
        """More than the store itself holds is not a transfer: the rest is not kept (anyone who
        may publish on the subject could otherwise fill this worker's memory)."""
        self._bytes = 0
        self._sub: Any = None
        self._arrived = anyio.Event()
        self.live: LiveFile | None = None

    @classmethod
    async def open(
        cls,
        nc: NATS,
        names: Names,
        transfer_id: str,
        *,
        max_bytes: int,
        dest: Path | None = None,
        window: int = 0,
        stored: bool = True,
    ) -> Incoming:
        """`window`: what the prefill job allows in flight (`PrefillRequest.window`); receipts
        go to the prefill worker as the messages come. 0: none. `stored`: as the prefill job says
        (`PrefillRequest.stored`)."""
        incoming = cls(max_bytes)
        if dest is not None:
            incoming.live = LiveFile(dest)
        receiving = Receiving(nc, names.kv_received(transfer_id), transfer_id, window)

        async def on_msg(msg: Msg) -> None:
            await receiving.took(len(msg.data))  # first: the prefill side goes on meanwhile
            incoming._bytes += len(msg.data)
            if incoming._bytes <= incoming.max_bytes:
                incoming.count += 1
                if incoming.live is not None:
                    incoming.live.put(msg.data)
                else:
                    incoming.messages.append(msg.data)
            incoming._arrived.set()

        incoming._sub = await nc.subscribe(
            names.kv_blocks(transfer_id) if stored else names.kv_live(transfer_id),
            cb=on_msg,
            pending_msgs_limit=-1,
            pending_bytes_limit=-1,
        )
        return incoming

    async def wait_for(self, count: int, quiet: float = 0.2) -> bool:
        """Whether `count` messages came, waiting while they still arrive (none for `quiet` s: stop)."""
        while self.count < count:
            seen = self.count
            self._arrived = anyio.Event()
            with anyio.move_on_after(quiet):
                await self._arrived.wait()
            if self.count == seen:
                break
        return self.count >= count

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
        if self.live is not None:
            self.live.close()
        self.messages = []


async def fetch_blocks(
    nc: NATS,
    names: Names,
    done: Prefilled,
    dest: Path,
    *,
    timeout: float,
    incoming: Incoming | None = None,
    window: int = WINDOW_BYTES,
    stored: bool = True,
) -> str:
    """Write the blocks `done` announces into the block file `dest`, every block checked against
    its checksum: from `incoming` when it holds them all and they check out, else from the store
    (if the blocks were `stored`). Returns which ("live" or "stored"); raises TransferFailed naming
    what is missing, late or wrong."""
    per_block = _check_answer(done)
    header = done.header
    n, per_message = header.num_blocks, done.blocks_per_message
    if incoming is not None and await _from_live(incoming, done, dest, stored):
        return "live"
    if not stored:
        got = incoming.count if incoming is not None else 0
        raise TransferFailed(
            f"{got} of {done.messages} messages arrived and the blocks were not stored: nothing to read back"
        )
    msgs: list[bytes] = []
    subject = names.kv_blocks(done.transfer_id)
    try:
        with anyio.fail_after(timeout):
            async for data in _direct_batch(nc, names.kv_blocks_stream, subject, done.messages, window):
                msgs.append(data)
    except TimeoutError:
        got = _blocks_in(len(msgs), per_block, per_message, n)
        raise TransferFailed(f"only {got} of {n} blocks arrived within {timeout:.1f}s") from None
    if len(msgs) < done.messages:
        got = _blocks_in(len(msgs), per_block, per_message, n)
        raise TransferFailed(f"only {got} of {n} blocks are in the store")
    await anyio.to_thread.run_sync(_assemble, msgs, done, dest)
    return "stored"


def _check_answer(done: Prefilled) -> int:
    """Chunks per block, once the answer is found consistent and unexpired."""
    header = done.header
    n, bb = header.num_blocks, header.block_bytes
    if len(done.checksums) != n or done.chunk_bytes <= 0:
        raise TransferFailed(f"the handoff names {len(done.checksums)} checksums for {n} blocks")
    try:
        blockfile.checksummer(header.checksum)
    except blockfile.BadBlockFile as exc:
        raise TransferFailed(str(exc)) from None
    per_message = done.blocks_per_message
    if per_message > 1 and per_message * bb > done.chunk_bytes:
        raise TransferFailed(f"the handoff packs {per_message} blocks in a {done.chunk_bytes}-byte chunk")
    per_block = chunks_per_block(bb, done.chunk_bytes) if bb else 0
    want = message_count(n, bb, done.chunk_bytes, per_message) if bb else 1 + n * per_block
    if done.messages != want:
        raise TransferFailed(f"the handoff says {done.messages} messages, its header means {want}")
    if done.expires_at < time.time():
        raise TransferFailed("the blocks expired before they were fetched")
    return per_block


async def _from_live(incoming: Incoming, done: Prefilled, dest: Path, stored: bool) -> bool:
    """Whether the blocks as received make `dest`: the live file, or the messages assembled.
    A damaged copy raises when the blocks were not `stored`; else the store decides."""
    if not await incoming.wait_for(done.messages):
        return False
    live = incoming.live
    if live is not None:
        problem = live.install(done.header, done.checksums) if live.dest == dest else "received elsewhere"
        if problem is None:
            return True
        if not stored:
            raise TransferFailed(problem)
        return False
    try:
        await anyio.to_thread.run_sync(_assemble, incoming.messages[: done.messages], done, dest)
        return True
    except TransferFailed:
        if not stored:
            raise
        return False


def _blocks_in(messages: int, per_block: int, per_message: int, num_blocks: int) -> int:
    if per_message > 1:
        return min(max(messages - 1, 0) * per_message, num_blocks)
    return max(messages - 1, 0) // per_block if per_block else 0


def _assemble(msgs: list[bytes], done: Prefilled, dest: Path) -> None:
    header = done.header
    n, bb = header.num_blocks, header.block_bytes
    try:
        sent = blockfile.decode_header(msgs[0])
    except blockfile.BadBlockFile as exc:
        raise TransferFailed(str(exc)) from None
    if sent != header:
        raise TransferFailed("the stored block header differs from the handoff's")
    checksum = blockfile.checksummer(header.checksum)
    tmp = dest.with_name(dest.name + ".part")
    try:
        with open(tmp, "wb") as f:
            head = blockfile.encode_header(header)
            f.write(blockfile.MAGIC + len(head).to_bytes(4, "little") + head)
            each = blocks(msgs[1:], n, bb, done.chunk_bytes, done.blocks_per_message)
            for j in range(n):
                try:
                    block = next(each)
                except (ValueError, StopIteration):
                    raise TransferFailed(f"block {j + 1} of {n} is cut short") from None
                if checksum(block) != done.checksums[j]:
                    raise TransferFailed(f"block {j + 1} of {n} fails its checksum")
                f.write(block)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


async def _direct_batch(
    nc: NATS, stream: str, subject: str, count: int, max_bytes: int
) -> AsyncGenerator[bytes, None]:
    """The payloads of the first `count` messages on `subject`, by batched direct gets: the server
    streams them to an inbox with no consumer to create, pace or delete (ADR-31; nats-server 2.11+),
    at most `max_bytes` a batch (a whole transfer at once could put this connection more than the
    server's max_pending behind, and get it cut).
    A server that sends fewer per batch than asked says so in its end-of-batch message, and the
    rest is asked for from there. Ends early when the subject holds fewer."""
    inbox = nc.new_inbox()
    send, recv = anyio.create_memory_object_stream[Msg](math.inf)
    sub = await nc.subscribe(inbox, cb=_forward(send), pending_msgs_limit=-1, pending_bytes_limit=-1)
    api = f"$JS.API.DIRECT.GET.{stream}"
    try:
        seq, left = 1, count
        while left:
            body = {"seq": seq, "next_by_subj": subject, "batch": left, "max_bytes": max_bytes}
            await nc.publish(api, json.dumps(body).encode(), reply=inbox)
            while True:
                msg = await recv.receive()
                status = (msg.headers or {}).get("Status")
                if status is None:
                    left -= 1
                    seq = int((msg.headers or {}).get("Nats-Sequence", seq)) + 1
                    yield msg.data
                    continue
                if status == "204" and left and int((msg.headers or {}).get("Nats-Num-Pending", 0)):
                    break  # the batch was capped: ask for the rest
                if status in ("204", "404"):
                    return
                raise TransferFailed(
                    f"the block store answered {status}: {(msg.headers or {}).get('Description')}"
                )
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await sub.unsubscribe()
            except Exception:
                pass


def _forward(send: Any) -> Any:
    async def cb(msg: Msg) -> None:
        send.send_nowait(msg)

    return cb


async def remove_blocks(nc: NATS, names: Names, transfer_id: str) -> None:
    await nc.jetstream().purge_stream(names.kv_blocks_stream, subject=names.kv_blocks(transfer_id))
