"""A queue per loaded adapter: jobs whose `model` names an adapter go to that adapter's own
subject (`jetllm.<ns>.jobs.<role>.<adapter>`), and only workers holding the adapter pull from it,
so such a job runs on a worker that has it and waits in JetStream while none does.

The base model's queue takes jobs that name the adapter in `GenerateRequest.adapter` instead;
any worker of the model takes those and answers a typed error if it lacks the adapter.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import anyio
from nats.aio.subscription import Subscription

from ..subjects.setup import ensure_consumer
from .puller import Puller

if TYPE_CHECKING:
    from .runtime import Worker

log = logging.getLogger(__name__)


class AdapterQueues:
    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self._pullers: dict[str, Puller] = {}
        self._advisories: dict[str, Subscription] = {}
        self._stopped = False
        self._lock = anyio.Lock()

    @property
    def pullers(self) -> list[Puller]:
        return list(self._pullers.values())

    def serves(self, model: str) -> bool:
        return model in self._pullers

    async def sync(self, adapters: list[str]) -> None:
        """Pull from the queue of every loaded adapter, and from no other."""
        async with self._lock:
            await self._sync(adapters)

    async def _sync(self, adapters: list[str]) -> None:
        for name in [n for n in self._pullers if n not in adapters]:
            self._pullers.pop(name).stop()
            await self._unsubscribe(name)
            log.info("no longer pulling jobs for adapter %r", name)
        for name in adapters:
            if name in self._pullers or self._stopped or self.w._jobs_tg is None:
                continue
            try:
                consumer = await ensure_consumer(self.w.js, self.w.names, self.w.role.role, name, self.w.config.policy)
                # A job of this queue that JetStream gives up on is dead-lettered like any other.
                self._advisories[name] = await self.w.nc.subscribe(
                    self.w.names.max_deliveries_advisory(self.w.role.role, name),
                    cb=self.w.dead_letters.on_max_deliveries,
                )
            except Exception as exc:
                log.warning("adapter %r: its queue is not pulled (%s); jobs naming it as the model wait", name, exc)
                continue
            if self._stopped:  # the worker began to stop while we set up: a puller now would never end
                await self._unsubscribe(name)
                continue
            self._start(name, consumer)

    async def _unsubscribe(self, name: str) -> None:
        sub = self._advisories.pop(name, None)
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:
                log.debug("adapter %r: advisory subscription not closed: %s", name, exc)

    def _start(self, name: str, consumer: str) -> None:
        w = self.w

        def free_slots() -> int:  # shared with the base queue: whichever delivers first takes a slot
            return 0 if w._paused else w.slots - w._busy

        puller = Puller(w.nc, w.names.jobs_stream, consumer, free_slots=free_slots, on_job=w._on_job,
                        expires=w.config.pull_expires)
        self._pullers[name] = puller
        assert w._jobs_tg is not None
        w._jobs_tg.start_soon(puller.run)
        log.info("pulling jobs for adapter %r from consumer %s", name, consumer)

    def wake(self) -> None:
        for p in self._pullers.values():
            p.wake()

    def stop(self) -> None:
        self._stopped = True
        for p in self._pullers.values():
            p.stop()
