"""This worker's own directed queue: jobs addressed to this instance (a router's placement).

Its consumer is made when the worker starts and retired when it stops cleanly (the server removes
it seconds later: workers may not delete consumers), after the jobs
still waiting there (and any it handed back) were moved to the shared queue, so a stopping worker
strands nothing. A worker that dies leaves them to the sweepers (`sweeper.py`).

Whether jobs wait is heard, not polled: the worker subscribes to its directed subject, so every
publish there tells it to pull (`pullshare.Waiting`); every sweep it also reads the consumer's own
count, which catches a job it did not hear (published while it reconnected, or handed back).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ..subjects.consumers import ensure_directed_consumer
from ..subjects.denials import checked
from ..subjects.direct import subscribe_direct
from ..subjects.handon import move_to_shared
from .context import WorkerContext
from .pulls import Pulls
from .pullshare import Waiting
from .running import RunningRequests

log = logging.getLogger(__name__)


class DirectedQueue:
    def __init__(
        self,
        ctx: WorkerContext,
        queue: str,
        pulls: Pulls,
        running: RunningRequests,
        *,
        on_exhausted: Callable[[Msg], Awaitable[None]],
    ) -> None:
        self._ctx = ctx
        self._pulls = pulls
        self._running = running
        self._on_exhausted = on_exhausted
        self.queue = queue
        self.subject = ctx.names.directed_jobs(queue, ctx.model, ctx.instance)
        self.consumer = ctx.names.directed_consumer(queue, ctx.model, ctx.instance)
        self.waiting = Waiting()
        self.moved_out = 0
        """Directed jobs this worker handed on to the shared queue when it stopped."""
        self._subs: list[Subscription] = []

    async def open(self) -> None:
        """Make the consumer and listen for jobs; before the worker pulls or says it serves. A
        subscription the server refuses fails the start, like the worker's others."""
        ctx = self._ctx
        await ensure_directed_consumer(ctx.js, ctx.names, self.queue, ctx.model, ctx.instance, ctx.policy)
        advisory = ctx.names.consumer_max_deliveries_advisory(self.consumer)
        async with checked(ctx.nc, "subscribe", self.subject, advisory):
            self._subs = [
                await subscribe_direct(ctx.nc, self.subject, self._heard),
                await ctx.nc.subscribe(advisory, cb=self._on_exhausted),
            ]

    def start(self) -> None:
        self._pulls.start_directed(self.consumer, self.waiting, counted=self._pulled)

    def _pulled(self) -> None:
        self._ctx.counters.directed += 1

    def _heard(self, msg: Msg) -> None:
        self.waiting.heard()
        self._pulls.wake()

    async def check(self) -> None:
        """Once a sweep: the consumer exists (the server removes one idle for long), and the jobs
        it holds that no pull took yet are counted as waiting."""
        ctx = self._ctx
        try:
            info = await ctx.js.consumer_info(ctx.names.jobs_stream, self.consumer)
        except nats.js.errors.NotFoundError:
            log.info("directed consumer %s was gone; making it again", self.consumer)
            await ensure_directed_consumer(ctx.js, ctx.names, self.queue, ctx.model, ctx.instance, ctx.policy)
            return
        held = sum(1 for run in self._running.values() if run.job.subject == self.subject)
        pending = (info.num_pending or 0) + max((info.num_ack_pending or 0) - held, 0)
        if pending > self.waiting.count:
            self.waiting.reported(pending)
            self._pulls.wake()

    async def move_waiting(self) -> int:
        """Hand on what waits here while this worker takes no jobs (asleep): a directed job must
        not wait for a wake nobody may send."""
        moved = await move_to_shared(self._ctx.js, self._ctx.names, self.subject)
        self._ctx.counters.moved += moved
        self.waiting.empty()
        if moved:
            log.info("asleep: handed %d directed jobs on to the shared queue", moved)
        return moved

    async def hand_on(self) -> None:
        """After pulling stopped and every job here was settled: move what waits in the directed
        queue (handed-back jobs included) to the shared queue, then retire the consumer (the server
        removes it seconds later). A failure
        is logged: the sweepers move the jobs once this instance's record is gone."""
        ctx = self._ctx
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            for sub in self._subs:
                try:
                    await sub.unsubscribe()
                except Exception as exc:
                    log.debug("directed subscription not closed: %s", exc)
            try:
                self.moved_out = await move_to_shared(ctx.js, ctx.names, self.subject)
                ctx.counters.moved += self.moved_out
                await ensure_directed_consumer(
                    ctx.js, ctx.names, self.queue, ctx.model, ctx.instance, ctx.policy, retire=True
                )
            except Exception as exc:
                log.warning("directed jobs not handed on (the sweepers will move them): %s", exc)
                return
            if self.moved_out:
                log.info("handed %d directed jobs on to the shared queue", self.moved_out)
