"""A queue per loaded adapter: jobs whose `model` names an adapter go to that adapter's own
subject (`jetllm.<ns>.jobs.<role>.<adapter>`), and only workers holding the adapter pull from it,
so such a job runs on a worker that has it and waits in JetStream while none does.

The base model's queue takes jobs that name the adapter in `GenerateRequest.adapter` instead;
any worker of the model takes those and answers a typed error if it lacks the adapter.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ..subjects.consumers import ensure_consumer
from .context import WorkerContext
from .pulls import Pulls

log = logging.getLogger(__name__)


class AdapterQueues:
    def __init__(
        self, ctx: WorkerContext, queue: str, pulls: Pulls, *, on_exhausted: Callable[[Msg], Awaitable[None]]
    ) -> None:
        self._ctx = ctx
        self._queue = queue
        self._pulls = pulls
        self._on_exhausted = on_exhausted
        self._consumers: dict[str, str] = {}
        self._advisories: dict[str, Subscription] = {}
        self._lock = anyio.Lock()

    def serves(self, model: str) -> bool:
        return model in self._consumers

    async def sync(self, adapters: list[str]) -> None:
        """Pull from the queue of every loaded adapter, and from no other."""
        async with self._lock:
            await self._sync(adapters)

    async def _sync(self, adapters: list[str]) -> None:
        ctx = self._ctx
        for name in [n for n in self._consumers if n not in adapters]:
            self._pulls.drop(self._consumers.pop(name))
            await self._unsubscribe(name)
            log.info("no longer pulling jobs for adapter %r", name)
        for name in adapters:
            if name in self._consumers or not self._pulls.accepting:
                continue
            try:
                consumer = await ensure_consumer(ctx.js, ctx.names, self._queue, name, ctx.policy)
                # A job of this queue that JetStream gives up on is dead-lettered like any other.
                self._advisories[name] = await ctx.nc.subscribe(
                    ctx.names.max_deliveries_advisory(self._queue, name),
                    cb=self._on_exhausted,
                )
            except Exception as exc:
                log.warning(
                    "adapter %r: its queue is not pulled (%s); jobs naming it as the model wait", name, exc
                )
                continue
            # The worker may have begun to stop while we set up: a puller now would never end.
            if self._pulls.start(consumer) is None:
                await self._unsubscribe(name)
                continue
            self._consumers[name] = consumer
            log.info("pulling jobs for adapter %r from consumer %s", name, consumer)

    async def _unsubscribe(self, name: str) -> None:
        sub = self._advisories.pop(name, None)
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:
                log.debug("adapter %r: advisory subscription not closed: %s", name, exc)
