"""Publishing one request's frames: numbering, encoding, and heartbeats while it is quiet."""

from __future__ import annotations

import logging
import time
from typing import Any

from nats.aio.client import Client as NATS

from ..schemas import (
    AcceptedFrame,
    Choice,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    HeartbeatFrame,
    TokensFrame,
    Usage,
)
from ..subjects import codec

log = logging.getLogger(__name__)


class FrameSink:
    """The frames of one request, sent over core NATS to the job's reply subject.

    A detached job (no reply subject) still gets its frames counted, just not sent.
    """

    def __init__(self, nc: NATS, reply_to: str | None, encoding: codec.Encoding, request_id: str) -> None:
        self._nc = nc
        self.reply_to = reply_to
        self.encoding = encoding
        self.request_id = request_id
        self.seq = 0
        self.last_sent = time.monotonic()
        self.frames_sent = 0

    async def _send(self, frame: Any) -> None:
        self.last_sent = time.monotonic()
        if self.reply_to is None:
            return
        try:
            await self._nc.publish(self.reply_to, codec.encode(frame, self.encoding))
            self.frames_sent += 1
        except Exception as exc:  # a lost frame shows as a gap or silence to the producer
            log.warning("request %s: frame %d not sent: %s", self.request_id, frame.seq, exc)

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    async def accepted(self, worker: str, model: str, attempt: int) -> None:
        await self._send(
            AcceptedFrame(seq=self._next(), request_id=self.request_id, worker=worker, model=model, attempt=attempt)
        )

    async def tokens(
        self,
        index: int,
        token_ids: list[int],
        text: str | None,
        logprobs: list[float] | None = None,
        top_logprobs: list[dict[int, float]] | None = None,
    ) -> None:
        await self._send(
            TokensFrame(
                seq=self._next(), index=index, token_ids=token_ids, text=text,
                logprobs=logprobs, top_logprobs=top_logprobs,
            )
        )

    async def final(self, choices: list[Choice], usage: Usage) -> None:
        await self._send(FinalFrame(seq=self._next(), request_id=self.request_id, choices=choices, usage=usage))

    async def error(self, code: ErrorCode, message: str, field: str | None = None, retryable: bool = False) -> None:
        await self._send(
            ErrorFrame(
                seq=self._next(), request_id=self.request_id, code=code, message=message,
                field=field, retryable=retryable,
            )
        )

    async def heartbeat_if_idle(self, now: float, interval: float) -> None:
        if now - self.last_sent >= interval:
            await self._send(HeartbeatFrame(seq=self.seq))
