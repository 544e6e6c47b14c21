"""Reading a request's outcome from its log in JetStream rather than from a producer's inbox.

Frames on the inbox reach only the producer listening at that moment; the request log keeps the
token frames (checkpointed every `--checkpoint-interval` of the worker) and the result (for
`results_max_age`). So a producer that went away, another
program, or a stream that lost frames to a reconnect can still get the whole output.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager

import anyio
import nats.js.errors
from nats.js import JetStreamContext

from ..errors import AcceptTimeout
from ..schemas import Cancelled, Frame, Record, Result, Step, Steps, TokensFrame
from ..subjects import codec, streamread
from ..subjects.names import Names
from .sequencer import rest_of

log = logging.getLogger(__name__)

_record_decoder = codec.KindDecoder(Record)


async def result(js: JetStreamContext, names: Names, request_id: str) -> Result | None:
    """How the request ended, if it has (stored for `results_max_age`)."""
    try:
        raw = await js.get_last_msg(names.requests_stream, names.request_log(request_id), direct=True)
    except nats.js.errors.NotFoundError:
        return None
    if not raw.data:
        return None
    try:
        record = _record_decoder.decode(raw.data)
    except codec.UnknownKind:  # a newer worker's record after the end, maybe: look further back
        return await _result_before(js, names, request_id)
    if isinstance(record, Cancelled):  # a cancel that came after the end changes nothing
        return await _result_before(js, names, request_id)
    return record if isinstance(record, Result) else None


async def result_quietly(js: JetStreamContext, names: Names, request_id: str) -> Result | None:
    try:
        return await result(js, names, request_id)
    except Exception:  # the log is unreachable for now; the watchdog asks again
        return None


async def attach(
    js: JetStreamContext, names: Names, request_id: str, accept_timeout: float | None = None
) -> AsyncGenerator[Frame, None]:
    """The frames of a request someone else submitted (or an earlier run of this program),
    read from the request log: everything delivered so far, then live until it ends. Raises
    AcceptTimeout when its log stays empty (no worker claimed it) for `accept_timeout` seconds."""
    done = await result(js, names, request_id)
    if done is not None:
        for frame in rest_of(done, [], 0):
            yield frame
        return
    seen: list[TokensFrame] = []
    contiguous = True
    async with aclosing(_records(js, names, request_id)) as records:
        async for record in _claimed_within(records, request_id, accept_timeout):
            for frame in _frames_in(record) if contiguous else ():
                if frame.seq == len(seen) + 1:
                    seen.append(frame)
                    yield frame
                elif frame.seq > len(seen) + 1:
                    contiguous = False  # rolled up under us: the result has the rest
                    break
            if isinstance(record, Result):
                for frame in rest_of(record, seen, len(seen)):
                    yield frame
                return


GAP_WAIT = 20.0
"""Seconds a producer waits for lost frames to appear in the request log: longer than a JetStream
cluster takes to elect a new leader for the log after its leader died (its raft election timeout
is 4-9 s), after which workers rewrite the records it dropped meanwhile."""


async def fill_gap(
    js: JetStreamContext,
    names: Names,
    request_id: str,
    seen: list[TokensFrame],
    after: int,
    before: int,
    *,
    n: int | None = None,
) -> list[Frame]:
    """Frames lost on the way (seq in (after, before)), recovered from the request log; if the
    request has ended, everything after `after` up to its final frame. Waits up to GAP_WAIT
    for records a worker is still writing or rewriting (after a reconnect or a failover).
    Raises RequestFailed (internal) for a result that does not fit the request's `n` choices."""
    steps: dict[int, TokensFrame] = {}
    ended = await result_quietly(js, names, request_id)
    subject, cursor = names.request_log(request_id), 1
    with anyio.move_on_after(GAP_WAIT):
        while ended is None and len(steps) < before - after - 1:
            try:
                async with aclosing(
                    streamread.messages(js, names.requests_stream, subject, start=cursor)
                ) as raws:
                    async for raw in raws:
                        cursor = (raw.seq or cursor) + 1
                        record = _readable(raw.data, request_id)
                        if isinstance(record, Result):
                            ended = record
                            break
                        for frame in _frames_in(record) if record is not None else ():
                            if after < frame.seq < before:
                                steps[frame.seq] = frame
            except Exception as exc:  # the server is still recovering its streams
                log.info("request %s: request log not readable yet: %s", request_id, exc)
            if ended is None and len(steps) < before - after - 1:
                await anyio.sleep(0.2)
    if ended is not None:
        found = rest_of(ended, seen, after, request_id=request_id, n=n)
    else:
        found = []
        for seq in range(after + 1, before):
            if seq not in steps:
                break
            found.append(steps[seq])
    log.warning("request %s: recovered %d lost frames from the request log", request_id, len(found))
    return found


def _readable(data: bytes | None, request_id: str) -> Record | None:
    """A log record; None for a kind this version does not know (written by a newer worker)."""
    try:
        return _record_decoder.decode(data or b"")
    except codec.UnknownKind as exc:
        log.debug("request %s: skipping a log record: %s", request_id, exc)
        return None


def _frames_in(record: Record) -> list[TokensFrame]:
    if isinstance(record, Steps):
        return record.frames
    if isinstance(record, Step):
        return [record.frame]
    return []


async def _result_before(js: JetStreamContext, names: Names, request_id: str) -> Result | None:
    """The last Result in the log, when records came after it (a late cancel)."""
    found = None
    try:
        async for raw in streamread.messages(js, names.requests_stream, names.request_log(request_id)):
            record = _readable(raw.data, request_id)
            if isinstance(record, Result):
                found = record
    except Exception:  # what was read so far is the best answer there is
        pass
    return found


async def _claimed_within(
    records: AsyncGenerator[Record, None], request_id: str, timeout: float | None
) -> AsyncGenerator[Record, None]:
    """`records`, the first of them (a worker's claim) due within `timeout` seconds."""
    first = None
    with anyio.move_on_after(timeout):
        first = await anext(records, None)
    if first is None:
        if timeout is not None:
            raise AcceptTimeout(f"request {request_id}: no worker accepted it within {timeout}s")
        return
    yield first
    async for record in records:
        yield record


async def _records(js: JetStreamContext, names: Names, request_id: str) -> AsyncGenerator[Record, None]:
    """The request log of `request_id` from its start, then live; kinds of records this version
    does not know (written by a newer worker) are left out."""
    async with _subscribed(js, names, request_id) as sub:
        async for msg in sub.messages:
            try:
                record = _record_decoder.decode(msg.data)
            except codec.UnknownKind as exc:
                log.debug("request %s: skipping a log record: %s", request_id, exc)
                continue
            yield record


@asynccontextmanager
async def _subscribed(
    js: JetStreamContext, names: Names, request_id: str
) -> AsyncIterator[JetStreamContext.PushSubscription]:
    """The request's log from its start; the subscription ends even when the reader is cancelled."""
    subject = names.request_log(request_id)
    sub = await js.subscribe(subject, stream=names.requests_stream, ordered_consumer=True)
    try:
        yield sub
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await sub.unsubscribe()
            except Exception:  # the connection is closing anyway
                pass
