"""Publishing one request's frames: numbering, encoding, checkpoints of what was sent, and
heartbeats while it is quiet."""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import msgspec
from nats.aio.client import Client as NATS

from ..schemas import (
    AcceptedFrame,
    Choice,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    HeartbeatFrame,
    PulledFrame,
    Result,
    Steps,
    TokensFrame,
    Usage,
)
from ..subjects import codec
from .framebatch import FrameBatcher

log = logging.getLogger(__name__)

CHECKPOINT_INTERVAL = 0.5
"""Seconds between request-log checkpoints of a request's token frames (`--checkpoint-interval`)."""
DETACHED_CHECKPOINT_INTERVAL = 5.0
"""The same for a detached job (`--detached-checkpoint-interval`): nobody saw its newest tokens, so
a worker that dies costs at most this long a generation again, and a batch line shorter than it
writes no checkpoint at all (docs/decisions.md)."""


class FrameSink:
    """The frames of one request, sent over core NATS to the job's reply subject.

    A detached job (no reply subject) still gets its frames counted, just not sent.
    """

    def __init__(
        self,
        nc: NATS,
        reply_to: str | None,
        encoding: codec.Encoding,
        request_id: str,
        *,
        attempt: int = 1,
        log_subject: str | None = None,
        checkpoint_interval: float = CHECKPOINT_INTERVAL,
        headers: dict[str, str] | None = None,
        batch: tuple[FrameBatcher, str] | None = None,
    ) -> None:
        self._nc = nc
        self._batch = batch
        """Where frames go together with other requests' (framebatch.py), when the producer reads batches."""
        self.reply_to = reply_to
        self.encoding = encoding
        self.request_id = request_id
        self.attempt = attempt
        self.log_subject = log_subject
        """Where token frames are checkpointed (the request log)."""
        self.checkpoint_interval = checkpoint_interval
        """0: every frame is recorded before it is sent. Otherwise the frames sent meanwhile are
        recorded together at most this often: the producer holds the newest (it answers the
        ResumeQuery of the worker that takes over), and a detached job's newest tokens were seen
        by nobody, so regenerating them loses nothing."""
        self.seq = 0
        self.sent_seq = 0
        """The highest seq handed to the connection: what a heartbeat repeats. `seq` runs ahead of it
        while a frame waits for its log record (a token) or for the result to be stored (the end)."""
        self.logged: list[TokensFrame] = []
        """This attempt's token frames, kept to rewrite any the log lost in a broker restart."""
        self._checkpointed = 0
        """How many of `logged` the last checkpoint covered."""
        self._checkpointed_at = time.monotonic()
        self.last_sent = time.monotonic()
        self.frames_sent = 0
        self.headers = headers
        """The trace context, sent with the accepted and the last frame: token frames and heartbeats
        go without headers, which the producer would parse once per token."""
        self.accepted_at: float | None = None
        self.first_token_at: float | None = None
        self.tokens_sent = 0
        self.resumed_tokens = 0
        self.ended_with: str | None = None
        """The finish reason or error code of the last frame, once sent."""
        self._held: anyio.Event | None = None

    def hold(self) -> None:
        """Token frames wait (unnumbered, unlogged) until release(): the request is not claimed yet."""
        if self._held is None:
            self._held = anyio.Event()

    def release(self) -> None:
        if self._held is not None:
            self._held.set()
            self._held = None

    async def _send(self, frame: Any, headers: dict[str, str] | None = None) -> None:
        self.last_sent = time.monotonic()
        if frame.seq > self.sent_seq:
            self.sent_seq = frame.seq
        if self.reply_to is None:
            return
        if self._batch is not None:
            batcher, subject = self._batch
            batcher.add(subject, self.reply_to, codec.encode(frame, self.encoding))
            self.frames_sent += 1
            return
        try:
            await self._nc.publish(self.reply_to, codec.encode(frame, self.encoding), headers=headers)
            self.frames_sent += 1
        except Exception as exc:  # a lost frame shows as a gap or silence to the producer
            log.warning("request %s: frame %d not sent: %s", self.request_id, frame.seq, exc)

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    async def pulled(self, worker: str, *, job_ack: str | None) -> None:
        await self._send(
            PulledFrame(
                seq=self.seq, attempt=self.attempt, request_id=self.request_id, worker=worker, job_ack=job_ack
            )
        )

    async def accepted(
        self, worker: str, model: str, *, resumed_tokens: int = 0, job_ack: str | None = None
    ) -> None:
        self.accepted_at = time.time()
        self.resumed_tokens = resumed_tokens
        await self._send(
            AcceptedFrame(
                seq=self.seq,
                attempt=self.attempt,
                request_id=self.request_id,
                worker=worker,
                model=model,
                resumed_tokens=resumed_tokens,
                job_ack=job_ack,
            ),
            self.headers,
        )

    async def replay(self, frames: list[TokensFrame]) -> None:
        """Send token frames an earlier attempt recorded; the producer drops those it has."""
        for frame in frames:
            await self._send(frame)
        self.seq = max(self.seq, frames[-1].seq if frames else 0)

    async def replay_result(self, result: Result, worker: str, model: str, *, job_ack: str | None) -> None:
        """Answer a request that already finished from its stored result, as this attempt's frames."""
        end = result.final or result.error
        if end is None:  # no worker writes this; someone wrote into the log by hand
            raise ValueError("the request's stored result has neither a final nor an error frame")
        self.log_subject = None  # the log already ends with this result
        self.seq = 0
        await self.accepted(worker, model, job_ack=job_ack)
        if result.final is not None:
            for index, ids in enumerate(result.token_ids):
                text = result.text[index] if result.text else None
                if ids or text:
                    await self.tokens(index, ids, text)
        await self.send(msgspec.structs.replace(end, seq=self.seq + 1, attempt=self.attempt))

    async def tokens(
        self,
        index: int,
        token_ids: list[int],
        text: str | None,
        logprobs: list[float] | None = None,
        top_logprobs: list[dict[int, float]] | None = None,
    ) -> None:
        if self._held is not None:
            await self._held.wait()
        frame = TokensFrame(
            seq=self._next(),
            attempt=self.attempt,
            index=index,
            token_ids=token_ids,
            text=text,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
        if self.first_token_at is None:
            self.first_token_at = time.time()
        self.tokens_sent += len(token_ids)
        if self.log_subject is not None:
            self.logged.append(frame)
            # Before the frame, on the same connection: with an interval of 0 the log never holds
            # less than was sent.
            await self.checkpoint_if_due(time.monotonic())
        await self._send(frame)

    async def checkpoint_if_due(self, now: float) -> None:
        if now - self._checkpointed_at >= self.checkpoint_interval:
            await self.checkpoint(now)

    async def checkpoint(self, now: float) -> None:
        """Record the token frames sent since the last checkpoint, as one record."""
        self._checkpointed_at = now
        pending = self.logged[self._checkpointed :]
        if not pending or self.log_subject is None:
            return
        self._checkpointed = len(self.logged)
        try:
            await self._nc.publish(
                self.log_subject, codec.encode(Steps(attempt=self.attempt, frames=pending))
            )
        except Exception as exc:  # the producer still holds them; a broker restart rewrites them
            log.warning("request %s: frames up to %d not logged: %s", self.request_id, pending[-1].seq, exc)

    def _ending(self) -> None:
        """The result is about to be stored: no checkpoint may follow it (its rollup keeps the last
        record, and readers take the last one for the result)."""
        self.log_subject = None

    def final_frame(self, choices: list[Choice], usage: Usage) -> FinalFrame:
        self._ending()
        return FinalFrame(
            seq=self._next(), attempt=self.attempt, request_id=self.request_id, choices=choices, usage=usage
        )

    def error_frame(
        self, code: ErrorCode, message: str, field: str | None = None, retryable: bool = False
    ) -> ErrorFrame:
        self._ending()
        return ErrorFrame(
            seq=self._next(),
            attempt=self.attempt,
            request_id=self.request_id,
            code=code,
            message=message,
            field=field,
            retryable=retryable,
        )

    async def send(self, frame: FinalFrame | ErrorFrame) -> None:
        """The request's one terminal frame; a second one (a failure after the end) is not sent."""
        if self.ended_with is not None:
            log.warning(
                "request %s: ended (%s) already; %s frame not sent",
                self.request_id,
                self.ended_with,
                frame.code.value if isinstance(frame, ErrorFrame) else "final",
            )
            return
        self.ended_with = (
            frame.code.value
            if isinstance(frame, ErrorFrame)
            else frame.choices[0].finish_reason
            if frame.choices
            else "stop"
        )
        await self._send(frame, self.headers)

    async def answer(self, message: Any, kind: str) -> None:
        """The job's one answer when it is not a stream of frames (a prefill's `Prefilled`);
        like a terminal frame, nothing is sent after it."""
        self._ending()
        if self.ended_with is not None:
            log.warning("request %s: ended (%s) already; %s not sent", self.request_id, self.ended_with, kind)
            return
        self.ended_with = "stop"
        self.last_sent = time.monotonic()
        if self.reply_to is None:
            return
        try:
            await self._nc.publish(self.reply_to, codec.encode(message, self.encoding), headers=self.headers)
            self.frames_sent += 1
        except Exception as exc:  # the requester times out and does the work itself
            log.warning("request %s: %s not sent: %s", self.request_id, kind, exc)

    async def heartbeat_if_idle(self, now: float, interval: float) -> None:
        if now - self.last_sent >= interval:
            await self._send(HeartbeatFrame(seq=self.sent_seq, attempt=self.attempt))
