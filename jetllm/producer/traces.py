"""Reading a request's trace records back (the producer side of `jetllm trace`)."""

from __future__ import annotations

import nats.errors
from nats.js import JetStreamContext

from ..schemas import TraceRecord
from ..subjects import codec
from ..subjects.names import Names

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
            found.append(_decoder.decode(msg.data))
            if msg.metadata.num_pending == 0:
                return found
    finally:
        await sub.unsubscribe()
