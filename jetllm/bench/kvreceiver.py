"""The receiving side of `jetllm bench-kv`, in a process of its own as a decode worker is: it
takes an order on a control subject, opens the subscription, says it is ready, and reports on
`bench.kvdone.<transfer>` once the bytes are in (the plain path) or the blocks are checked and
written (jetllm's path). Run by bench/kvtransfer.py; not a command of its own.

    python -m jetllm.bench.kvreceiver URL NAMESPACE CONTROL_SUBJECT WORK_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

import anyio
import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from ..aio import task_group
from ..kvtransfer.pacing import Receiving
from ..kvtransfer.transport import Incoming, fetch_blocks, remove_blocks
from ..kvtransfer.window import WINDOW_BYTES
from ..schemas.disagg import Prefilled
from ..subjects.connection import connect
from ..subjects.names import Names


class ReceiveOrder(msgspec.Struct, kw_only=True):
    path: Literal["plain", "jetllm"]
    transfer: str
    messages: int
    """Messages the plain path sends (jetllm's answer says its own)."""
    stored: bool = False


class Received(msgspec.Struct, kw_only=True):
    error: str | None = None


def plain_subjects(transfer: str) -> tuple[str, str, str]:
    """Where the plain path's bytes go, its receipts, and jetllm's answer."""
    return f"bench.plain.{transfer}", f"bench.plainrecv.{transfer}", f"bench.answer.{transfer}"


def done_subject(transfer: str) -> str:
    return f"bench.kvdone.{transfer}"


async def _plain(nc: NATS, order: ReceiveOrder, ready: anyio.Event) -> None:
    subject, receipts_to, _ = plain_subjects(order.transfer)
    receiving = Receiving(nc, receipts_to, order.transfer, WINDOW_BYTES)
    got, seen = anyio.Event(), [0]

    async def on_msg(msg: Msg) -> None:
        seen[0] += 1
        if seen[0] == order.messages:
            got.set()
        await receiving.took(len(msg.data))

    sub = await nc.subscribe(subject, cb=on_msg, pending_bytes_limit=-1, pending_msgs_limit=-1)
    await nc.flush()
    ready.set()
    await got.wait()
    await sub.unsubscribe()


async def _jetllm(nc: NATS, names: Names, order: ReceiveOrder, work: Path, ready: anyio.Event) -> None:
    dest = work / f"{order.transfer}.kv"
    incoming = await Incoming.open(
        nc, names, order.transfer, max_bytes=1 << 40, dest=dest, window=WINDOW_BYTES, stored=order.stored
    )
    answers = await nc.subscribe(plain_subjects(order.transfer)[2], max_msgs=1)
    await nc.flush()
    ready.set()
    try:
        msg = await answers.next_msg(timeout=120)
        done = msgspec.msgpack.decode(msg.data, type=Prefilled)
        await fetch_blocks(nc, names, done, dest, timeout=120, incoming=incoming, stored=order.stored)
    finally:
        await incoming.close()
        if order.stored:
            await remove_blocks(nc, names, order.transfer)
        dest.unlink(missing_ok=True)


async def serve(url: str, namespace: str, control: str, work: Path) -> None:
    nc = await connect(url, name="bench-kv-receiver")
    names = Names(namespace)
    orders = await nc.subscribe(control)
    await nc.publish(f"{control}.up", b"")
    async with task_group() as tg:

        async def run(order: ReceiveOrder, ready: anyio.Event) -> None:
            error = None
            try:
                if order.path == "plain":
                    await _plain(nc, order, ready)
                else:
                    await _jetllm(nc, names, order, work, ready)
            except Exception as exc:  # reported to the bench, which stops with it
                error = f"{type(exc).__name__}: {exc}"
            ready.set()
            await nc.publish(done_subject(order.transfer), msgspec.msgpack.encode(Received(error=error)))

        async for msg in orders.messages:
            if not msg.data:
                break  # the bench is done
            order = msgspec.msgpack.decode(msg.data, type=ReceiveOrder)
            ready = anyio.Event()
            tg.start_soon(run, order, ready)
            await ready.wait()
            await msg.respond(b"ready")
        tg.cancel_scope.cancel()
    await nc.close()


if __name__ == "__main__":
    url, namespace, control, work = sys.argv[1:5]
    anyio.run(serve, url, namespace, control, Path(work))
