"""Reading a request's trace records back (the producer side of `jetllm trace`)."""

from __future__ import annotations

import logging

import msgspec
import nats.errors
from nats.js import JetStreamContext

from ..schemas import TraceRecord
from ..subjects import codec
from ..subjects.names import Names

log = logging.getLogger(__name__)

_decoder = codec.Decoder(TraceRecord)


async def trace_records(
    js: JetStreamContext, names: Names, request_id: str | None = None
) -> list[TraceRecord]:
    """Every stored hop of `request_id` (of every request when None), in the order they ended."""
    subject = names.trace_all if request_id is None else names.trace(request_id)
    sub = await js.subscribe(subject, stream=names.traces_stream, ordered_consumer=True)
    found: list[TraceRecord] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except nats.errors.TimeoutError:
                return found
            try:
                found.append(_decoder.decode(msg.data))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # one bad record hides no other
                log.warning(
                    "trace record %d on %s skipped: %s", msg.metadata.sequence.stream, msg.subject, exc
                )
            if msg.metadata.num_pending == 0:
                return found
    finally:
        await sub.unsubscribe()
