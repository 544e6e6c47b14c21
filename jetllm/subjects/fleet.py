"""Asking the running workers of a namespace about themselves (scatter-gather over core NATS)."""

from __future__ import annotations

import time

import anyio
from nats.aio.client import Client as NATS

from ..schemas import StatusRequest, WorkerStatus
from . import codec
from .names import Names

_decoder = codec.Decoder(WorkerStatus)


async def worker_statuses(nc: NATS, names: Names, timeout: float = 0.5) -> list[WorkerStatus]:
    """Every worker that answers within `timeout`, sorted by instance id."""
    inbox = nc.new_inbox()
    replies: list[WorkerStatus] = []
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(names.control("status"), codec.encode(StatusRequest()), reply=inbox)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except Exception:
                break
            try:
                replies.append(_decoder.decode(msg.data))
            except Exception:
                continue
    finally:
        await sub.unsubscribe()
    return sorted(replies, key=lambda s: s.instance)


async def wait_for_workers(
    nc: NATS, names: Names, *, model: str | None = None, count: int = 1, timeout: float = 120.0
) -> list[WorkerStatus]:
    """Wait until `count` workers (of `model`, if given) are serving; raises TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        found = [
            s for s in await worker_statuses(nc, names, timeout=0.3)
            if s.state == "serving" and (model is None or s.model == model)
        ]
        if len(found) >= count:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(found)} of {count} workers serving after {timeout}s")
        await anyio.sleep(0.2)
