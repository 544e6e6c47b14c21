"""A routing decision as a hop of the request's trace (`jetllm trace` shows it before the worker's)."""

from __future__ import annotations

import logging
import time

from nats.aio.client import Client as NATS

from .. import tracecontext
from ..schemas import GenerateRequest, RouteDecision, TraceRecord
from ..subjects import codec
from ..subjects.names import Names

log = logging.getLogger(__name__)


def decision_record(
    req: GenerateRequest,
    decision: RouteDecision,
    *,
    router: str,
    traceparent: str | None,
    queued_at: float,
    started: float,
) -> TraceRecord:
    parsed = tracecontext.parse(traceparent)
    trace_id, parent = parsed if parsed is not None else (tracecontext.new_traceparent()[3:35], None)
    return TraceRecord(
        trace_id=trace_id,
        span_id=tracecontext.new_span_id(),
        parent_span_id=parent,
        request_id=req.request_id,
        hop="router",
        instance=router,
        attempt=0,
        model=req.model,
        queued_at=queued_at,
        pulled_at=started,
        ended_at=time.time(),
        outcome="directed" if decision.chosen is not None else "shared",
        route=decision,
    )


async def publish_decision(
    nc: NATS,
    names: Names,
    req: GenerateRequest,
    decision: RouteDecision,
    *,
    router: str,
    traceparent: str | None,
    queued_at: float,
    started: float,
) -> None:
    rec = decision_record(
        req, decision, router=router, traceparent=traceparent, queued_at=queued_at, started=started
    )
    log.debug("route %s -> %s: %s", req.request_id, decision.chosen or "shared queue", decision.why)
    try:
        await nc.publish(names.trace(req.request_id), codec.encode(rec))
    except Exception as exc:  # the decision stands without its record
        log.debug("routing record not published: %s", exc)


def route_lines(rec: TraceRecord) -> list[str]:
    """A router's record as `jetllm trace` prints it: the decision, then each candidate weighed."""
    d = rec.route
    if d is None:
        return []
    to = f"to {d.chosen}" if d.chosen is not None else "to the shared queue"
    lines = [f"routed by {rec.instance} {to}: {d.why} (decided in {d.decision_us:.0f} us)"]
    for c in d.candidates:
        lines.append(
            f"  {c.instance}: {c.cached_tokens}/{d.prompt_tokens} prompt tokens cached, "
            f"load {c.running}+{c.waiting}/{c.slots}, cost {c.cost:.0f}"
        )
    return lines
