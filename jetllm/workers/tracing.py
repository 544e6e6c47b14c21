"""One worker hop of a request's trace: the span that the job's `traceparent` header continues,
the header its frames carry, and the timing record published when the hop ends.

Records go to the trace stream and to the log (one line, so `grep <trace id>` over worker logs
shows the path too); OpenTelemetry gets a span when an exporter is configured
(OTEL_EXPORTER_OTLP_ENDPOINT and the opentelemetry SDK installed).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from nats.aio.client import Client as NATS

from .. import tracecontext
from ..schemas import TraceRecord
from ..subjects import codec
from ..subjects.names import Names

log = logging.getLogger(__name__)


class Hop:
    __slots__ = (
        "trace_id",
        "parent",
        "span_id",
        "queued_at",
        "pulled_at",
        "started_at",
        "accepted_at",
        "header",
    )

    def __init__(self, msg: Any, received_at: float | None = None) -> None:
        """`received_at`: when the connection handed the worker `msg` (default: now)."""
        parsed = tracecontext.parse((msg.headers or {}).get(tracecontext.HEADER))
        if parsed is None:  # no usable header: this hop starts the trace
            self.trace_id, self.parent = tracecontext.new_traceparent()[3:35], None
        else:
            self.trace_id, self.parent = parsed
        self.span_id = tracecontext.new_span_id()
        self.header = {tracecontext.HEADER: tracecontext.child(self.trace_id, self.span_id)}
        self.started_at = time.time()
        self.pulled_at = received_at or self.started_at
        try:
            self.queued_at = msg.metadata.timestamp.timestamp()
        except Exception:
            self.queued_at = self.pulled_at
        self.accepted_at: float | None = None

    def record(
        self,
        *,
        request_id: str,
        instance: str,
        model: str,
        attempt: int,
        frames: Any,
        outcome: str,
        prefill: str | None = None,
        queue: str = "shared",
    ) -> TraceRecord:
        return TraceRecord(
            trace_id=self.trace_id,
            span_id=self.span_id,
            parent_span_id=self.parent,
            request_id=request_id,
            instance=instance,
            attempt=attempt,
            model=model,
            queued_at=self.queued_at,
            pulled_at=self.pulled_at,
            started_at=self.started_at,
            accepted_at=frames.accepted_at,
            first_token_at=frames.first_token_at,
            ended_at=time.time(),
            outcome=outcome,
            resumed_tokens=frames.resumed_tokens,
            completion_tokens=frames.tokens_sent,
            frames=frames.frames_sent,
            prefill=prefill,
            queue=queue,
        )


def outcome_of(frames: Any, settled_how: str | None) -> str:
    """A hop that sent no end frame still has an outcome: what became of its job (handed back, or
    superseded by a newer delivery when this hop did not settle it)."""
    if frames.ended_with is not None:
        return "completed" if frames.ended_with in ("stop", "length") else frames.ended_with
    settled = {"nak": "handed_back", "term": "terminated", "ack": "completed"}
    return settled.get(settled_how or "", "superseded")


class TracePublisher:
    def __init__(self, nc: NATS, names: Names) -> None:
        self.nc = nc
        self.names = names
        self._otel = _otel_tracer()

    async def publish(self, rec: TraceRecord) -> None:
        # A completed hop's line is a debug line: at thousands of jobs a second, a line each would
        # cost the worker more CPU than its JetStream record, and `jetllm trace` reads the record.
        log.log(
            logging.DEBUG if rec.outcome == "completed" else logging.INFO,
            "trace %s request %s attempt %d on %s (%s): %s, queued %.0f ms, first token %s, "
            "%d tokens in %d frames, %.0f ms",
            rec.trace_id,
            rec.request_id,
            rec.attempt,
            rec.instance,
            rec.queue,
            rec.outcome,
            (rec.pulled_at - rec.queued_at) * 1000,
            f"{(rec.first_token_at - rec.pulled_at) * 1000:.0f} ms" if rec.first_token_at else "-",
            rec.completion_tokens,
            rec.frames,
            (rec.ended_at - rec.pulled_at) * 1000,
        )
        try:
            await self.nc.publish(
                self.names.trace(rec.request_id),
                codec.encode(rec),
                headers={tracecontext.HEADER: tracecontext.child(rec.trace_id, rec.span_id)},
            )
        except Exception as exc:
            log.debug("trace record not published: %s", exc)
        if self._otel is not None:
            _export(self._otel, rec)


def _otel_tracer() -> Any:
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK/exporter is not installed")
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": "jetllm-worker"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return trace.get_tracer("jetllm", tracer_provider=provider)


def _export(tracer: Any, rec: TraceRecord) -> None:
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    parent = None
    if rec.parent_span_id:
        ctx = SpanContext(
            int(rec.trace_id, 16), int(rec.parent_span_id, 16), is_remote=True, trace_flags=TraceFlags(1)
        )
        parent = trace.set_span_in_context(NonRecordingSpan(ctx))
    span = tracer.start_span(
        "jetllm.generate",
        context=parent,
        start_time=int(rec.queued_at * 1e9),
        attributes={
            "jetllm.request_id": rec.request_id,
            "jetllm.instance": rec.instance,
            "jetllm.attempt": rec.attempt,
            "jetllm.outcome": rec.outcome,
            "jetllm.completion_tokens": rec.completion_tokens,
        },
    )
    span.add_event("pulled", timestamp=int(rec.pulled_at * 1e9))
    if rec.first_token_at:
        span.add_event("first_token", timestamp=int(rec.first_token_at * 1e9))
    span.end(end_time=int(rec.ended_at * 1e9))
