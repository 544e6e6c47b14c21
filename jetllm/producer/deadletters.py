"""Reading and replaying the dead-letter stream of a namespace."""

from __future__ import annotations

import msgspec
import nats.js.errors
from nats.aio.client import Client as NATS

from ..schemas import MAX_SHARD_REQUESTS, DeadLetter
from ..subjects import codec
from ..subjects.names import SHARD_QUEUE, Names

_decoder = codec.Decoder(DeadLetter)


class Entry(msgspec.Struct, kw_only=True):
    seq: int
    """Sequence of the record in the dead-letter stream: what `show` and `replay` take."""
    record: DeadLetter


async def entries(nc: NATS, names: Names, *, limit: int | None = None) -> list[Entry]:
    js = nc.jetstream()
    try:
        info = await js.stream_info(names.dlq_stream)
    except nats.js.errors.NotFoundError:
        return []
    first, last = info.state.first_seq, info.state.last_seq
    if limit is not None:
        first = max(first, last - limit + 1)
    out = []
    seq = first
    while seq <= last:
        try:
            raw = await js.get_msg(names.dlq_stream, seq, next=True)
        except nats.js.errors.NotFoundError:
            break
        # nats-py types a fetched message's seq and data Optional; get_msg always fills them
        out.append(Entry(seq=raw.seq, record=_decoder.decode(raw.data)))  # type: ignore[arg-type]
        seq = raw.seq + 1  # type: ignore[operator]
    return out


async def get(nc: NATS, names: Names, seq: int) -> Entry:
    raw = await nc.jetstream().get_msg(names.dlq_stream, seq)
    return Entry(seq=raw.seq, record=_decoder.decode(raw.data))  # type: ignore[arg-type]  # nats-py: Optional


def shard_requests(names: Names, rec: DeadLetter) -> list[str]:
    """The request ids a dead-lettered shard names (none for any other job)."""
    try:
        if names.parse_jobs(rec.subject)[0] != SHARD_QUEUE:
            return []
        encoding = codec.encoding_of(rec.headers)
    except (ValueError, codec.UnknownContentType):  # not a shard's letter
        return []
    return codec.shard_request_ids(rec.payload, encoding, MAX_SHARD_REQUESTS)


async def replay(nc: NATS, names: Names, entry: Entry, *, keep: bool = False) -> str:
    """Publish the job again as it was, so it runs afresh; returns the job subject.

    The request's stored result (its error) and any durable cancel are cleared first, or the
    worker would answer the replay from them; a new message id keeps JetStream's duplicate window
    from dropping it.
    """
    js = nc.jetstream()
    rec = entry.record
    # a whole shard's letter: each request it names had the shard's error stored as its result
    for rid in [rec.request_id] if rec.request_id else shard_requests(names, rec):
        await js.purge_stream(names.requests_stream, subject=names.request_log(rid))
        try:
            await js.purge_stream(names.cancels_stream, subject=names.cancelled(rid))
        except nats.js.errors.NotFoundError:  # a namespace whose workers predate durable cancels
            pass
    headers = dict(rec.headers)
    headers["Nats-Msg-Id"] = f"{headers.get('Nats-Msg-Id', rec.request_id or 'job')}~replay{entry.seq}"
    await js.publish(rec.subject, rec.payload, headers=headers)
    if not keep:
        await js.delete_msg(names.dlq_stream, entry.seq)
    return rec.subject
