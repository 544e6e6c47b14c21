"""Frames of many requests to one producer, sent as one message per turn of the event loop.

An engine step yields a token frame for every running request at once. A producer that runs many
requests (a batch pipeline, a gateway, the benchmark) would get one message per request per step,
and on both sides nats-py parses and dispatches each message in Python: on a small box that CPU
is taken from the engine. A producer that can read batches says so on its jobs (the
`Jetllm-Frame-Batch` header names its batch subject); the frames a worker sends it during one turn
of the event loop then leave as one `FrameBatch` message, in the order they were sent. Frames of
jobs without the header are sent singly, as before.
"""

from __future__ import annotations

import logging

import anyio
import msgspec
from nats.aio.client import Client as NATS

from ..cutting import consecutive
from ..schemas import BatchedFrame, FrameBatch
from ..subjects import codec
from ..subjects.names import frame_batch_subject, is_safe_reply_subject

log = logging.getLogger(__name__)

ENTRY_OVERHEAD = 16
"""Bytes a frame adds to a batch besides its own and its subject's (msgpack keys and lengths)."""


def batch_subject(
    headers: dict[str, str] | None, reply_to: str | None, encoding: codec.Encoding
) -> str | None:
    """The subject this job's frames may be batched to, or None (send them singly).

    The header is the producer's word, so it is checked like a reply subject, and it must be the
    reply subject's own `.batch` sibling: a job cannot point frames anywhere its reply_to could not.
    Only msgpack frames are batched (a JSON frame cannot be embedded as is)."""
    subject = (headers or {}).get(codec.FRAME_BATCH_HEADER)
    if subject is None or reply_to is None or encoding != "msgpack":
        return None
    if not is_safe_reply_subject(subject) or subject != frame_batch_subject(reply_to) or subject == reply_to:
        return None
    return subject


def split(frames: list[BatchedFrame], sizes: list[int], limit: int) -> list[list[BatchedFrame]]:
    """Consecutive parts of `frames` whose sizes add up to at most `limit` each (a frame bigger than
    `limit` goes alone: its publish fails as it would have alone)."""
    return consecutive(frames, sizes, limit)


class FrameBatcher:
    """Collects frames per batch subject; `run` (a worker service) sends them once the turn is over."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._pending: dict[str, tuple[list[BatchedFrame], list[int]]] = {}
        self._wake = anyio.Event()

    def add(self, subject: str, reply_to: str, data: bytes) -> None:
        entry = self._pending.get(subject)
        if entry is None:
            entry = self._pending[subject] = ([], [])
            self._wake.set()
        entry[0].append(BatchedFrame(to=reply_to, frame=msgspec.Raw(data)))
        entry[1].append(len(data) + len(reply_to) + ENTRY_OVERHEAD)

    async def run(self) -> None:
        """Wakes after the tasks that were ready with the first frame have run (they add theirs
        first), sends, sleeps again; a last send when cancelled, so a final frame is never left."""
        try:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                await self.flush()
        finally:
            with anyio.CancelScope(shield=True):
                await self.flush()

    async def flush(self) -> None:
        pending, self._pending = self._pending, {}
        limit = max(1024, (self._nc.max_payload or 1 << 20) - codec.HEADER_MARGIN)
        for subject, (frames, sizes) in pending.items():
            for part in split(frames, sizes, limit):
                try:
                    await self._nc.publish(subject, codec.encode(FrameBatch(frames=part)))
                except Exception as exc:  # lost frames show as a gap, which the producer fills from the log
                    log.warning("%d frames to %s not sent: %s", len(part), subject, exc)
