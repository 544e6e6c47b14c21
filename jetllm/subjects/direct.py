"""Subscriptions whose messages are handled inside nats-py's read loop, with no task hop.

nats-py hands every message of a callback subscription to a per-subscription task, which then
calls the callback: on a busy event loop each hop waits for a whole loop iteration. Token frames
(producer side) and pulled jobs (worker side) are latency-critical, so their handlers run
synchronously as the message is parsed. A handler must be quick and never block; anything slow
goes to a task of its own.

This replaces the subscription's private pending queue (nats-py 2.x); the version range in
pyproject.toml pins the client it was written against, and the test suite exercises it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger(__name__)


class _Handoff(asyncio.Queue):
    def __init__(self, sub: Subscription, handler: Callable[[Msg], None]) -> None:
        super().__init__()
        self._sub = sub
        self._handler = handler

    def put_nowait(self, msg: Msg) -> None:
        self._sub._pending_size -= len(msg.data)
        try:
            self._handler(msg)
        except Exception:  # a handler bug must not kill the connection's read loop
            log.exception("handler of %s failed", self._sub.subject)


async def subscribe_direct(nc: NATS, subject: str, handler: Callable[[Msg], None]) -> Subscription:
    sub = await nc.subscribe(subject)
    sub._pending_queue = _Handoff(sub, handler)
    return sub
