"""The request log: what a request has delivered, so another worker can continue it.

Records go to `jetllm.<ns>.req.<request>` (stream JETLLM_<NS>_REQUESTS). A worker checkpoints
the token frames it sent every `--checkpoint-interval` (one `Steps` record for all of them); the
newest frames live only at the producer, which hands them to the worker that takes the request
over (docs/durability.md, "Who holds the delivered tokens"). When the request ends, everything but the Result is
purged: the Result stays for producers that were not listening (batch jobs) and for
redeliveries of a finished job. Only workers write the log; a producer's durable cancel has a
subject of its own (`Cancelled`).
"""

from __future__ import annotations

from .common import Report, Tolerant
from .frames import ErrorFrame, FinalFrame, TokensFrame


class _Record(Report, kw_only=True, tag_field="kind"):
    attempt: int
    """Delivery count of the job when the record was written."""


class Claim(_Record, tag="claim"):
    """An attempt starts running the request."""

    worker: str
    at: float


class Step(_Record, tag="step"):
    """A token frame as it was sent to the producer (written by versions before checkpoints, and
    still read)."""

    frame: TokensFrame


class Steps(_Record, tag="steps"):
    """Token frames sent since the previous checkpoint, in seq order."""

    frames: list[TokensFrame]


class Handoff(_Record, tag="handoff"):
    """A draining worker handed the request back on purpose (not counted as a migration)."""

    reason: str


class Cancelled(_Record, tag="cancelled"):
    """The producer cancelled the request: whoever pulls the job later drops it unrun. Stored on
    `jetllm.<ns>.cancelled.<request>`, apart from the log, which producers may not write (producers
    before that stored it in the log, where workers still read it). Anything stored on that
    subject is read as a cancel, whatever it holds."""

    reason: str | None = None


class ChoiceLogprobs(Tolerant, kw_only=True):
    """One choice's log-probabilities, as its token frames carried them: enough to build the
    response a stream of those frames gave (a batch line's is built from it)."""

    logprobs: list[float]
    """Per generated token."""
    top_logprobs: list[dict[int, float]] = []
    """Per generated token: the most likely token ids and their log-probabilities."""
    text_offsets: list[int] = []
    """Per generated token: where the text of the frame that carried it begins in the choice's
    text (OpenAI's `text_offset`, which a frame's text cannot be split further for)."""


class Result(_Record, tag="result"):
    """How the request ended: its final frame (with the whole output) or its error frame."""

    final: FinalFrame | None = None
    error: ErrorFrame | None = None
    token_ids: list[list[int]] = []
    """All generated tokens, per choice."""
    text: list[str] | None = None
    """All generated text, per choice, when text was produced."""
    logprobs: list[ChoiceLogprobs] | None = None
    """Per choice, when a detached job (no `reply_to`: a batch line) asked for log-probabilities;
    a producer that streams has them from the frames. A Result they would make larger than a
    message is stored as a `payload_too_large` error naming `$.output.logprobs` instead."""
    worker: str = ""
    migrations: int = 0
    """Times a worker died under the request and another continued it."""


Record = Claim | Step | Steps | Handoff | Cancelled | Result
