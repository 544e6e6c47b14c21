"""Where one request went and how long each hop took: a record per worker attempt, on
`jetllm.<ns>.trace.<request>` (a limits stream), correlated by the W3C trace id that travels in
the `traceparent` header of the job, its frames and its control messages."""

from __future__ import annotations

from .common import Report, Tolerant


class RouteCandidate(Tolerant, kw_only=True):
    """One instance a router weighed for a job."""

    instance: str
    cached_tokens: int
    """Prompt tokens the router expects the instance's engine to find cached."""
    cost: float
    running: int = 0
    waiting: int = 0
    slots: int = 0
    kv_usage: float | None = None


class RouteDecision(Tolerant, kw_only=True):
    """Where a router sent a job and why (the trace record of hop "router")."""

    chosen: str | None
    """The instance the job was addressed to; None: the shared queue."""
    why: str
    prompt_tokens: int = 0
    expected_cached_tokens: int = 0
    """The chosen instance's cached tokens as the router predicts them (0 for the shared queue)."""
    candidates: list[RouteCandidate] = []
    """Cheapest first; at most the 8 cheapest."""
    decision_us: float = 0.0
    """Time to decide, tokenizing included (microseconds)."""


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
    """When the worker's connection handed it the job."""
    started_at: float | None = None
    """When the job's task first ran: after `pulled_at` by the turns a busy event loop takes to
    reach it (None: a worker from before 2026-12-02)."""
    accepted_at: float | None = None
    first_token_at: float | None = None
    ended_at: float
    outcome: str
    """completed | cancelled | handed_back | superseded | deferred | an error code."""
    resumed_tokens: int = 0
    completion_tokens: int = 0
    frames: int = 0
    route: RouteDecision | None = None
    """Set on a router's record (hop "router"): the placement decision."""
    prefill: str | None = None
    """Where the prompt was prefilled, for roles that choose: `remote on <instance> (...)`, or
    `local: <why>` (a short prompt, no prefill worker, a full prefill queue, a failed handoff)."""
    queue: str = "shared"
    """How the job reached this worker: `shared` (the model's queue), `directed` (addressed to this
    instance), or `moved from <instance>` (addressed to an instance that stopped or died, then
    handed on to the shared queue)."""
