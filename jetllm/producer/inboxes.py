"""Where a client's frames land: one wildcard subscription, one inbox per request.

Every request of a client gets its own reply subject under one inbox root, so thousands of
concurrent requests cost one subscription; a worker may also send the frames of several of them
in one message (workers/framebatch.py) to the root's batch subject. A request waits on its inbox,
and one watchdog wakes the requests whose wait ran out: a timer per request per frame costs too
much on this path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import anyio
import msgspec
from nats.aio.msg import Msg

from ..schemas import FrameBatch
from ..subjects import codec
from ..subjects.names import FRAME_BATCH_TOKEN

log = logging.getLogger(__name__)
_batch_decoder = codec.Decoder(FrameBatch)

WATCH_PERIOD_S = 0.1
"""The watchdog's longest sleep: a deadline set meanwhile is noticed within this."""


class Inbox:
    """Frames of one request: a deque and one waiter, lighter than asyncio.Queue on this hot path.
    An item is a frame's bytes, None (a wake-up) or a message to answer (a worker's ResumeQuery)."""

    __slots__ = ("items", "waiter", "deadline")

    def __init__(self) -> None:
        self.items: deque[bytes | Msg | None] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.deadline: float | None = None
        """Monotonic time at which the watchdog puts a None (a wake-up) in the inbox."""

    def put(self, data: bytes | Msg | None) -> None:
        self.items.append(data)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self) -> bytes | Msg | None:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


class Inboxes:
    """The inboxes of one client's open requests, under one subject root."""

    __slots__ = ("root", "_open", "_start")

    def __init__(self, root: str) -> None:
        self.root = root
        """The subscription covers `root.*`: one token per request, plus the batch subject."""
        self._open: dict[str, Inbox] = {}
        self._start = len(root) + 1

    def subject(self, token: str) -> str:
        return f"{self.root}.{token}"

    def open(self, token: str) -> Inbox:
        inbox = self._open[token] = Inbox()
        return inbox

    def close(self, token: str) -> None:
        self._open.pop(token, None)

    def on_message(self, msg: Msg) -> None:
        """The subscription's callback: a frame goes to its request's inbox; a frame batch is split."""
        key = msg.subject[self._start :]
        inbox = self._open.get(key)
        if inbox is not None:
            inbox.put(msg if msg.reply else msg.data)  # frames never ask for a reply
        elif key == FRAME_BATCH_TOKEN:
            self._on_batch(msg.data)

    def _on_batch(self, data: bytes) -> None:
        try:
            batch = _batch_decoder.decode(data)
        except msgspec.DecodeError as exc:
            log.warning("ignoring an unreadable frame batch: %s", exc)
            return
        for entry in batch.frames:
            inbox = self._open.get(entry.to[self._start :]) if entry.to.startswith(self.root) else None
            if inbox is not None:
                inbox.put(bytes(entry.frame))

    async def watch(self) -> None:
        """Wake each request whose deadline passed, once per deadline (the request re-arms it).

        Sleeps until the nearest deadline it knows of, at most WATCH_PERIOD_S, so a ping is on time."""
        pause = WATCH_PERIOD_S
        while True:
            await anyio.sleep(pause)
            now = time.monotonic()
            pause = WATCH_PERIOD_S
            for inbox in list(self._open.values()):
                if inbox.deadline is None:
                    continue
                if now >= inbox.deadline:
                    inbox.deadline = None
                    inbox.put(None)
                else:
                    pause = min(pause, inbox.deadline - now)
