"""Moving directed jobs to the shared queue: what a stopping worker does with its own, and what a
sweeper does with those of an instance that is gone (the decisions are in `directed.py`).

A move is republish, then delete: a mover that dies between the two leaves a copy behind, which
the next mover publishes under the same message id (dropped as a duplicate), so a job is never
lost and never queued twice; should a copy ever run twice, the request log's claim lets only one
of them produce the request.
"""

from __future__ import annotations

import logging

import nats.js.errors
from nats.js import JetStreamContext

from .directed import moved_headers
from .names import Names

log = logging.getLogger(__name__)
_NO_MESSAGE = 10057


async def directed_backlog(js: JetStreamContext, names: Names) -> dict[str, int]:
    """Every directed subject holding jobs now, with how many (one stream-info request)."""
    info = await js.stream_info(names.jobs_stream, subjects_filter=names.directed_jobs_all)
    return dict(info.state.subjects or {})


async def move_to_shared(js: JetStreamContext, names: Names, subject: str) -> int:
    """Move every job waiting on the directed `subject` to its shared queue; returns how many
    this call moved (a job another mover moved first is not counted)."""
    parsed = names.parse_directed(subject)
    if parsed is None:
        raise ValueError(f"not a directed job subject of namespace {names.namespace!r}: {subject!r}")
    role, model, instance = parsed
    shared = names.jobs(role, model)
    moved = 0
    seq = 1
    while True:
        try:
            msg = await js.get_msg(names.jobs_stream, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return moved
        if msg.seq is None:
            return moved
        ack = await js.publish(shared, msg.data or b"", headers=moved_headers(msg.headers, msg.seq, instance))
        try:
            await js.delete_msg(names.jobs_stream, msg.seq)
        except nats.js.errors.APIError as exc:
            if exc.err_code != _NO_MESSAGE and not isinstance(exc, nats.js.errors.NotFoundError):
                raise  # else another mover deleted it first
        if not ack.duplicate:
            moved += 1
        seq = msg.seq + 1
