"""The router's view of the fleet, kept current: KV-cache events into the index (replayed from
the stream's oldest batch on start, then live), load reports, and the registry's live instances.

Anyone on the bus can publish events and reports naming any instance, so the router keeps state
only for the instances (and their data-parallel ranks) the registry shows: the registry bounds
its memory, not the names that come by. Events of an instance not registered (yet) wait briefly
in a bounded hold (early.py); reports of one are dropped (the next comes within a second)."""

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
from .early import EarlyBatches
from .gaps import SeqCheck, check_seq
from .hashing import BlockHasher
from .index import BlockIndex

log = logging.getLogger(__name__)

RESYNC_EVERY = 10.0
"""Seconds between two kv-resync requests to one instance."""
RELEASE_EVERY = 0.5
"""Seconds between two looks at the held batches (are their instances registered now?)."""

Registered = Callable[[str], InstanceRecord | None]
"""The registry record of an instance the router counts as live, else None."""

_batches = codec.Decoder(KvEventBatch)
_loads = codec.Decoder(LoadReport)


class KvFeed:
    def __init__(
        self,
        nc: NATS,
        names: Names,
        model: str,
        index: BlockIndex,
        hasher: Callable[[], BlockHasher | None],
        *,
        registered: Registered,
    ) -> None:
        """`registered`: the live record of an instance (None: not in the registry); only the
        ranks it lists are indexed."""
        self.nc = nc
        self.names = names
        self.model = model
        self.index = index
        self._hasher = hasher
        self._registered = registered
        self.last: dict[str, int] = {}
        """Per registered instance, the last batch seq applied."""
        self.caught_up = anyio.Event()
        """Set once every batch stored when the feed started is applied."""
        self.early = EarlyBatches()
        """Batches of instances the registry does not show yet."""
        self.counters = {
            "batches": 0,
            "events": 0,
            "gaps": 0,
            "undecodable": 0,
            "resyncs_asked": 0,
            "held_unregistered": 0,
            "applied_late": 0,
            "dropped_unregistered": 0,
            "dropped_unlisted_rank": 0,
        }
        self._asked: dict[str, float] = {}
        self._next_release = 0.0

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
                    msg = None
                if msg is not None:
                    await self.take(msg)
                now = time.monotonic()
                if self.early and now >= self._next_release:
                    self._next_release = now + RELEASE_EVERY
                    await self._ask_resyncs(self.release(now))
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
        await self._ask_resyncs(self.admit(batch, time.monotonic()))

    def admit(self, batch: KvEventBatch, now: float) -> list[str]:
        """Applies `batch` if its instance is registered (after the batches held for it), holds it
        if not; returns the instances to ask for a snapshot. Synchronous: no other batch and no
        registry change comes between the check and the index."""
        if self._registered(batch.instance) is None:
            held, dropped = self.early.hold(batch, now)
            self.counters["held_unregistered"] += held
            self.counters["dropped_unregistered"] += dropped + (not held)
            return []
        asks = self._release_of([batch.instance]) if self.early.holds(batch.instance) else []
        return asks + self._apply_registered(batch)

    def release(self, now: float) -> list[str]:
        """Applies the held batches whose instances are registered now, drops those held too
        long; returns the instances to ask for a snapshot."""
        self.counters["dropped_unregistered"] += self.early.expire(now)
        ready = [inst for inst in self.early.instances() if self._registered(inst) is not None]
        return self._release_of(ready) if ready else []

    def _release_of(self, instances: list[str]) -> list[str]:
        asks: list[str] = []
        for held in self.early.take(set(instances)):
            self.counters["applied_late"] += 1
            asks += self._apply_registered(held)
        return asks

    def _apply_registered(self, batch: KvEventBatch) -> list[str]:
        record = self._registered(batch.instance)
        if record is None or batch.dp_rank not in record.dp_ranks:
            self.counters["dropped_unlisted_rank"] += 1
            return []
        verdict = check_seq(self.last.get(batch.instance), batch)
        if verdict is SeqCheck.STALE:
            return []
        slot = self.index.slot(batch.instance, batch.dp_rank)
        asks = []
        if verdict is not SeqCheck.APPLY:
            if verdict is SeqCheck.GAP:
                self.counters["gaps"] += 1
                for n in self.index.slots_of(batch.instance):
                    self.index.clear(n)  # unknown until its snapshot: predict nothing rather than wrong
            asks.append(batch.instance)
        self.last[batch.instance] = batch.seq
        self.index.apply(slot, batch.events, self._hasher())
        self.counters["batches"] += 1
        self.counters["events"] += len(batch.events)
        return asks

    def forget(self, instance: str) -> None:
        """The instance left the registry: its seq and its last snapshot request go (the router
        drops its index slots and load reports)."""
        self.last.pop(instance, None)
        self._asked.pop(instance, None)

    async def _ask_resyncs(self, instances: list[str]) -> None:
        for instance in instances:
            await self._ask_resync(instance)

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
    """The latest load report of each rank of each registered instance, for `max_age` seconds.

    Keyed instance -> rank, so one instance's reports are found without looking at the others';
    reports older than `max_age` are dropped (at most every `max_age` seconds, when one comes)."""

    def __init__(self, max_age: float = 5.0, registered: Registered | None = None) -> None:
        """`registered`: as for KvFeed; reports of other instances, or of ranks their record does
        not list, are dropped (None: every report is kept)."""
        self.max_age = max_age
        self._registered = registered
        self.reports: dict[str, dict[int, tuple[float, LoadReport]]] = {}
        """Instance -> rank -> (when it came, the report)."""
        self.counters = {
            "reports": 0,
            "undecodable": 0,
            "dropped_unregistered": 0,
            "dropped_unlisted_rank": 0,
            "expired": 0,
        }
        self._next_sweep = 0.0

    def __len__(self) -> int:
        """Reports kept (one per rank)."""
        return sum(len(ranks) for ranks in self.reports.values())

    def take(self, msg: Msg) -> None:
        try:
            report = _loads.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            self.counters["undecodable"] += 1
            return
        self.put(report, time.monotonic())

    def put(self, report: LoadReport, now: float) -> bool:
        """Keeps `report` as its rank's latest; False: dropped (no such registered rank)."""
        if self._registered is not None:
            record = self._registered(report.instance)
            if record is None:
                self.counters["dropped_unregistered"] += 1
                return False
            if report.dp_rank not in record.dp_ranks:
                self.counters["dropped_unlisted_rank"] += 1
                return False
        if now >= self._next_sweep:
            self.sweep(now)
        self.reports.setdefault(report.instance, {})[report.dp_rank] = (now, report)
        self.counters["reports"] += 1
        return True

    def of(self, instance: str, now: float | None = None) -> list[LoadReport]:
        ranks = self.reports.get(instance)
        if not ranks:
            return []
        now = time.monotonic() if now is None else now
        return [r for at, r in ranks.values() if now - at <= self.max_age]

    def sweep(self, now: float) -> None:
        """Drops the reports older than `max_age`."""
        self._next_sweep = now + self.max_age
        for instance in list(self.reports):
            ranks = self.reports[instance]
            old = [rank for rank, (at, _) in ranks.items() if now - at > self.max_age]
            for rank in old:
                del ranks[rank]
            self.counters["expired"] += len(old)
            if not ranks:
                del self.reports[instance]

    def forget(self, instance: str) -> None:
        self.reports.pop(instance, None)


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
