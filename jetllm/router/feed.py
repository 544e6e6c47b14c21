"""The router's view of the fleet, kept current: KV-cache events into the index (replayed from
the stream's oldest batch on start, then live), load reports, and the registry's live instances."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import aclosing

import anyio
import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from ..producer.registry import watch
from ..schemas import InstanceRecord, KvEventBatch, LoadReport
from ..subjects import codec
from ..subjects.names import Names
from .gaps import SeqCheck, check_seq
from .hashing import BlockHasher
from .index import BlockIndex

log = logging.getLogger(__name__)

RESYNC_EVERY = 10.0
"""Seconds between two kv-resync requests to one instance."""

_batches = codec.Decoder(KvEventBatch)
_loads = codec.Decoder(LoadReport)


class KvFeed:
    def __init__(
        self, nc: NATS, names: Names, model: str, index: BlockIndex, hasher: Callable[[], BlockHasher | None]
    ) -> None:
        self.nc = nc
        self.names = names
        self.model = model
        self.index = index
        self._hasher = hasher
        self.last: dict[str, int] = {}
        """Per instance, the last batch seq applied."""
        self.caught_up = anyio.Event()
        """Set once every batch stored when the feed started is applied."""
        self.counters = {"batches": 0, "events": 0, "gaps": 0, "undecodable": 0, "resyncs_asked": 0}
        self._asked: dict[str, float] = {}

    async def run(self, stopped: Callable[[], bool] = lambda: False) -> None:
        """Until `stopped()`: checked between messages (at least every second), so a router stops
        without cancelling a NATS call midway (nats-py's flush leaves a cancelled future behind
        that breaks the connection's later flushes)."""
        js = self.nc.jetstream()
        sub = await js.subscribe(
            self.names.kv_events_of(self.model),
            stream=self.names.kv_events_stream,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
            idle_heartbeat=2.0,
        )
        try:
            info = await sub.consumer_info()
            if info.num_pending == 0 and not (info.delivered and info.delivered.consumer_seq):
                self.caught_up.set()
            while not stopped():
                try:
                    msg = await sub.next_msg(timeout=1.0)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                await self.take(msg)
        finally:
            try:
                await sub.unsubscribe()
            except Exception:
                pass

    async def take(self, msg: Msg) -> None:
        try:
            batch = _batches.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            self.counters["undecodable"] += 1
        else:
            await self.apply(batch)
        try:
            if msg.metadata.num_pending == 0:
                self.caught_up.set()
        except Exception:
            pass

    async def apply(self, batch: KvEventBatch) -> None:
        verdict = check_seq(self.last.get(batch.instance), batch)
        if verdict is SeqCheck.STALE:
            return
        slot = self.index.slot(batch.instance, batch.dp_rank)
        if verdict is not SeqCheck.APPLY:
            if verdict is SeqCheck.GAP:
                self.counters["gaps"] += 1
                for n in self.index.slots_of(batch.instance):
                    self.index.clear(n)  # unknown until its snapshot: predict nothing rather than wrong
            await self._ask_resync(batch.instance)
        self.last[batch.instance] = batch.seq
        self.index.apply(slot, batch.events, self._hasher())
        self.counters["batches"] += 1
        self.counters["events"] += len(batch.events)

    async def _ask_resync(self, instance: str) -> None:
        now = time.monotonic()
        if now - self._asked.get(instance, -RESYNC_EVERY) < RESYNC_EVERY:
            return
        self._asked[instance] = now
        self.counters["resyncs_asked"] += 1
        try:
            await self.nc.publish(self.names.instance_control(instance, "kv-resync"), b"")
        except Exception as exc:
            log.info("could not ask %s for a KV resync: %s", instance, exc)


class LoadBook:
    """The latest load report of each (instance, rank)."""

    def __init__(self, max_age: float = 5.0) -> None:
        self.max_age = max_age
        self.reports: dict[tuple[str, int], tuple[float, LoadReport]] = {}

    def take(self, msg: Msg) -> None:
        try:
            report = _loads.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return
        self.reports[(report.instance, report.dp_rank)] = (time.monotonic(), report)

    def of(self, instance: str, now: float | None = None) -> list[LoadReport]:
        now = time.monotonic() if now is None else now
        return [
            r for (inst, _), (at, r) in self.reports.items() if inst == instance and now - at <= self.max_age
        ]

    def forget(self, instance: str) -> None:
        for key in [k for k in self.reports if k[0] == instance]:
            del self.reports[key]


async def follow_registry(
    nc: NATS,
    names: Names,
    model: str,
    role: str,
    on_change: Callable[[dict[str, InstanceRecord]], None],
    stopped: Callable[[], bool] = lambda: False,
) -> None:
    """Calls `on_change` with the model's live instances of `role`, after every registry change
    (and every second), until `stopped()`."""
    updates = watch(nc.jetstream(timeout=5), names)
    async with aclosing(updates):  # type: ignore[type-var]  # an async generator, typed as an iterator
        async for current in updates:
            if stopped():
                return
            on_change({r.instance: r for r in current.values() if r.model == model and r.role == role})
