"""Every worker sweeps: directed jobs waiting for an instance that is gone (SIGKILLed, or its
machine lost) are moved to the shared queue, so none is stranded.

Once per registry interval (jittered, so a fleet does not sweep in step) a worker lists the
directed subjects that hold jobs (one stream-info request), and for each instance other than
itself decides from its registry record (`directed.sweep_verdict`), pinging it when the record
still looks alive. Two sweepers moving the same jobs at once publish each job once: the moved
copy's message id comes from the original's stream sequence (`directed.moved_msg_id`).
The same pass keeps this worker's own directed queue in order (`DirectedQueue.check`), and while
the worker is paused (asleep) hands on whatever waits there.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from ..schemas import InstanceRecord
from ..subjects import codec
from ..subjects.consumers import ensure_directed_consumer
from ..subjects.directed import sweep_verdict
from ..subjects.handon import directed_backlog, move_to_shared
from ..subjects.setup import ensure_registry
from .context import WorkerContext
from .directed import DirectedQueue

log = logging.getLogger(__name__)
_record = codec.Decoder(InstanceRecord)

PING_TIMEOUT = 0.5


class Sweeper:
    def __init__(
        self, ctx: WorkerContext, own: DirectedQueue, *, interval: float, paused: Callable[[], bool]
    ) -> None:
        self._ctx = ctx
        self._own = own
        self._paused = paused
        self._interval = interval
        self._kv: KeyValue | None = None
        self.moved = 0
        """Jobs of gone instances this worker moved to the shared queue."""

    async def run(self) -> None:
        while True:
            await anyio.sleep(self._interval * random.uniform(0.75, 1.25))
            try:
                if self._paused():
                    await self._own.move_waiting()
                else:
                    await self._own.check()
                await self.sweep()
            except (nats.errors.Error, OSError) as exc:  # an outage: the next pass tries again
                log.warning("directed jobs not swept this time: %s", exc)

    async def sweep(self) -> int:
        """One pass; returns how many jobs it moved."""
        ctx = self._ctx
        moved = 0
        for subject in await directed_backlog(ctx.js, ctx.names):
            parsed = ctx.names.parse_directed(subject)
            if parsed is None:
                continue
            role, model, instance = parsed
            verdict = sweep_verdict(instance, ctx.instance, await self._record(instance), time.time())
            if verdict == "skip" or (verdict == "ping" and not await self._gone(instance)):
                continue
            n = await move_to_shared(ctx.js, ctx.names, subject)
            await ensure_directed_consumer(ctx.js, ctx.names, role, model, instance, ctx.policy, retire=True)
            if n:
                log.warning("moved %d directed jobs of %s (gone) to the shared queue", n, instance)
            moved += n
        self.moved += moved
        ctx.counters.moved += moved
        return moved

    async def _record(self, instance: str) -> InstanceRecord | None:
        ctx = self._ctx
        if self._kv is None:
            self._kv = await ensure_registry(ctx.js, ctx.names, replicas=ctx.policy.replicas)
        try:
            entry = await self._kv.get(ctx.names.instance_key(instance))
        except nats.js.errors.KeyNotFoundError:
            return None
        if not entry.value:
            return None
        try:
            return _record.decode(entry.value)
        except msgspec.DecodeError:
            return None  # not a record a worker wrote: no live instance behind it

    async def _gone(self, instance: str) -> bool:
        """Only "no responders" is gone: the server says so once the instance's connection closed."""
        try:
            await self._ctx.nc.request(
                self._ctx.names.instance_control(instance, "ping"), b"", timeout=PING_TIMEOUT
            )
        except nats.errors.NoRespondersError:
            return True
        except Exception:
            return False
        return False
