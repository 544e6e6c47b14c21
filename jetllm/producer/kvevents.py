"""Reading KV-cache events: an ordered replay of a model's (or one instance's) batches from any
point, with jumps in an instance's `seq` reported as gaps.

A router keeps one block set per (instance, dp_rank), applies each batch's events in order, and
on a gap drops that instance's set until the instance's next resync arrives (`resync_on_gap`
asks for one at once). See docs/fleet.md, "KV-cache events".
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import ConsumerConfig, DeliverPolicy

from ..schemas import KvEventBatch
from ..subjects import codec
from ..subjects.names import Names

_decoder = codec.Decoder(KvEventBatch)


class KvDelivery(msgspec.Struct, kw_only=True):
    batch: KvEventBatch
    stream_seq: int
    """Where the batch sits in the stream: a checkpoint to start from next time."""
    missed: int = 0
    """Batches of this instance that are not in the stream before this one (expired: resync)."""


async def _next_on_subject(nc: NATS, names: Names, subject: str, at: int) -> tuple[int, int] | None:
    """(stream seq, batch seq) of the first batch on `subject` at or after stream seq `at`."""
    try:
        raw = await nc.jetstream().get_msg(names.kv_events_stream, seq=at, subject=subject, next=True)
    except nats.js.errors.NotFoundError:
        return None
    return raw.seq or at, _decoder.decode(raw.data or b"").seq


async def stream_seq_of(nc: NATS, names: Names, model: str, instance: str, seq: int) -> int | None:
    """The stream sequence of the instance's first retained batch with `seq` or later (a bisection
    over the stream: an instance's seqs grow with the stream's); None when there is none."""
    subject = names.kv_events(model, instance)
    state = (await nc.jetstream().stream_info(names.kv_events_stream)).state
    lo, hi = max(1, state.first_seq), state.last_seq + 1
    while lo < hi:
        mid = (lo + hi) // 2
        found = await _next_on_subject(nc, names, subject, mid)
        if found is None or found[1] >= seq:
            hi = mid
        else:
            lo = found[0] + 1
    found = await _next_on_subject(nc, names, subject, lo) if lo <= state.last_seq else None
    return found[0] if found is not None else None


def _start_at(stream_seq: int | None, new_only: bool) -> ConsumerConfig:
    if stream_seq is not None and not new_only:
        return ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=stream_seq)
    return ConsumerConfig(deliver_policy=DeliverPolicy.NEW if new_only else DeliverPolicy.ALL)


async def kv_events(
    nc: NATS,
    names: Names,
    model: str,
    *,
    instance: str | None = None,
    start_seq: int | None = None,
    stream_seq: int | None = None,
    new_only: bool = False,
    follow: bool = True,
    resync_on_gap: bool = False,
    idle_timeout: float | None = None,
) -> AsyncIterator[KvDelivery]:
    """The batches of `model` (of one `instance`, if given) in stream order.

    Start at the instance's batch `start_seq` (needs `instance`), at stream sequence `stream_seq`,
    with batches published from now on (`new_only`), or else at the oldest batch kept. Without
    `follow`, stop after the last batch stored when the replay began. `idle_timeout` ends a
    followed replay that stays silent that long.
    """
    if start_seq is not None and instance is None:
        raise ValueError("start_seq counts one instance's batches: name the instance")
    js = nc.jetstream()
    subject = names.kv_events(model, instance) if instance else names.kv_events_of(model)
    if start_seq is not None and start_seq > 1:
        assert instance is not None
        stream_seq = await stream_seq_of(nc, names, model, instance, start_seq)
        if stream_seq is None:  # nothing that recent yet: wait for it
            new_only = True
    config = _start_at(stream_seq, new_only)
    sub = await js.subscribe(
        subject, stream=names.kv_events_stream, ordered_consumer=True, config=config, idle_heartbeat=2.0
    )
    last: dict[str, int] = {instance: start_seq - 1} if instance and start_seq else {}
    try:
        if not follow:
            info = await sub.consumer_info()
            if info.num_pending == 0 and not (info.delivered and info.delivered.consumer_seq):
                return  # nothing stored (pending excludes what was already pushed to us)
        while True:
            try:
                msg = await sub.next_msg(timeout=idle_timeout)
            except TimeoutError:
                return
            try:
                batch = _decoder.decode(msg.data)
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue  # not ours to read; the per-instance seq shows whether a batch is missing
            meta = msg.metadata
            seen = last.get(batch.instance)
            missed = batch.seq - seen - 1 if seen is not None and batch.seq > seen + 1 else 0
            if seen is None or batch.seq > seen:
                last[batch.instance] = batch.seq
            if missed and resync_on_gap:
                await nc.publish(names.instance_control(batch.instance, "kv-resync"), b"")
            yield KvDelivery(batch=batch, stream_seq=meta.sequence.stream, missed=missed)
            if not follow and meta.num_pending == 0:
                return
    finally:
        try:
            await sub.unsubscribe()
        except Exception:
            pass
