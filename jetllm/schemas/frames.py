"""Reply frames, streamed on the job's reply subject; `kind` tells them apart.

`seq` counts the frames that carry output (tokens, final, error) from 1 with no gaps, across
every worker a request runs on. Accepted and heartbeat frames repeat the last seq sent, so a
producer notices a lost frame even while the request is quiet; a pulled frame comes before the
worker has read the log and carries no seq a producer acts on.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from .common import ErrorCode, Report, Tolerant

FinishReason = Literal["stop", "length", "cancelled", "error", "repetition"]


class _Frame(Report, kw_only=True, tag_field="kind"):
    seq: int
    """1, 2, 3, ... over the output frames of a request; a gap means a frame was lost."""
    attempt: int = 1
    """Which delivery of the job sent the frame; a migrated request continues with a higher one."""


class PulledFrame(_Frame, tag="pulled"):
    """A worker has pulled the job and is reading its request log; `accepted` follows once it has
    claimed it. Sent at once, so that a worker dying in between is noticed by a ping rather than by
    ack_wait. Not an output frame: seq is the last seq this worker knows of (0 before the log)."""

    request_id: str
    worker: str
    """Instance id of the worker that holds the delivery."""
    job_ack: str | None = None
    """The delivery's ack subject, to NAK should the worker be gone before it accepts."""


class AcceptedFrame(_Frame, tag="accepted"):
    """A worker has taken the job: first frame, and again (higher attempt) after a migration."""

    request_id: str
    worker: str
    """Instance id of the worker that runs the job."""
    model: str
    resumed_tokens: int = 0
    """Tokens of choice 0 delivered by earlier attempts; this attempt continues after them."""
    job_ack: str | None = None
    """The job's JetStream ack subject: a producer that finds the worker dead publishes `-NAK`
    to it, so the job moves on at once instead of after ack_wait."""


class TokensFrame(_Frame, tag="tokens"):
    """New tokens since the previous frame (deltas: concatenating them gives the output)."""

    token_ids: list[int]
    index: int = 0
    """Choice index, for n > 1."""
    text: str | None = None
    """Text delta, when text was asked for; held back while it may still become a stop string."""
    logprobs: list[float] | None = None
    """Log-probability of each token in token_ids (when output.logprobs is set)."""
    top_logprobs: list[dict[int, float]] | None = None
    """Per token: the most likely token ids and their log-probabilities."""


class HeartbeatFrame(_Frame, tag="heartbeat"):
    """Sent while a request is quiet (queued in the engine, long prefill); seq is the last seq sent."""


class Usage(Tolerant, kw_only=True):
    prompt_tokens: int
    """Tokens of the rendered prompt (after the chat template)."""
    completion_tokens: int
    """Generated tokens, all choices together."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""


class Choice(Tolerant, kw_only=True):
    index: int
    finish_reason: FinishReason
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the choice; None for EOS or length."""
    completion_tokens: int


class FinalFrame(_Frame, tag="final"):
    """Last frame of a request that finished: one entry per choice, and the usage."""

    request_id: str
    choices: list[Choice]
    usage: Usage


class ErrorFrame(_Frame, tag="error"):
    """Last frame of a request that failed."""

    request_id: str | None
    code: ErrorCode
    message: str
    """What went wrong, for a human; names the limit or the field where there is one."""
    field: str | None = None
    """The offending field, as a path such as `$.stop.max_tokens`, when there is one."""
    retryable: bool = False
    """Whether submitting the same job again may succeed."""


Frame = PulledFrame | AcceptedFrame | TokensFrame | HeartbeatFrame | FinalFrame | ErrorFrame


class ResumeQuery(Report, kw_only=True):
    """Sent by the worker taking a request over, as a NATS request on its reply subject: the
    request log holds token frames only up to the last checkpoint, so the newest ones delivered
    are known to the producer alone. Frames of older attempts that arrive after the answer are
    dropped, so the answer is final."""

    request_id: str
    attempt: int
    """The attempt taking over."""
    after: int
    """The last seq the request log holds; the answer starts after it."""


class Delivered(Report, kw_only=True):
    """The producer's answer to a ResumeQuery: the token frames it holds after `after`, in seq order."""

    frames: list[TokensFrame] = []


class BatchedFrame(Tolerant, kw_only=True):
    to: str
    """The request's reply subject."""
    frame: msgspec.Raw
    """The frame, encoded as it would be sent alone (msgpack)."""


class FrameBatch(Report, kw_only=True):
    """Frames of several requests of one producer, sent together on its batch subject when its jobs
    carry the `Jetllm-Frame-Batch` header; in the order the worker sent them."""

    frames: list[BatchedFrame]
