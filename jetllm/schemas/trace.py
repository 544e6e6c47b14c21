"""Where one request went and how long each hop took: a record per worker attempt, on
`jetllm.<ns>.trace.<request>` (a limits stream), correlated by the W3C trace id that travels in
the `traceparent` header of the job, its frames and its control messages."""

from __future__ import annotations

from .common import Report


class TraceRecord(Report, kw_only=True):
    trace_id: str
    """32 hex digits, from the job's `traceparent` header (or new, when it had none)."""
    span_id: str
    """This hop's span (16 hex digits); its parent is the producer's span from the header."""
    parent_span_id: str | None = None
    request_id: str
    hop: str = "worker"
    instance: str
    attempt: int
    model: str
    queued_at: float
    """When JetStream stored the job (producer's submit), epoch seconds."""
    pulled_at: float
    accepted_at: float | None = None
    first_token_at: float | None = None
    ended_at: float
    outcome: str
    """completed | cancelled | handed_back | superseded | deferred | an error code."""
    resumed_tokens: int = 0
    completion_tokens: int = 0
    frames: int = 0
    prefill: str | None = None
    """Where the prompt was prefilled, for roles that choose: `remote on <instance> (...)`, or
    `local: <why>` (a short prompt, no prefill worker, a full prefill queue, a failed handoff)."""
    queue: str = "shared"
    """How the job reached this worker: `shared` (the model's queue), `directed` (addressed to this
    instance), or `moved from <instance>` (addressed to an instance that stopped or died, then
    handed on to the shared queue)."""
