"""Every queue a worker pulls from, as one: its role's queue, one queue per loaded adapter, and
its own directed queue.

The pullers share the worker's slots (whichever delivers first takes a slot), so they are woken
together when a slot frees, stopped together when the worker stops, and asked together whether
any still holds pull credit (a sleep must wait until none does) or can still receive a job (a
hand-back must wait until none can, or the job could come straight back here). The directed
queue goes first when both have jobs waiting (`pullshare.py` has the rules).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from ..aio import supervised
from .puller import Puller
from .pullshare import Waiting, directed_allowance, shard_allowance, shard_kept, shared_allowance
from .slots import Slots
from .tasks import JobTasks

DIRECTED_EXPIRES = 1.0
"""Seconds a directed pull waits: it is sent when a directed job was heard, which can be just
before JetStream stored it; it asks only for the jobs heard, so it seldom waits at all."""

log = logging.getLogger(__name__)


class Pulls:
    def __init__(
        self,
        nc: NATS,
        stream: str,
        *,
        free_slots: Callable[[], int],
        on_job: Callable[[Msg], None],
        expires: float,
        tasks: JobTasks,
    ) -> None:
        self._nc = nc
        self._stream = stream
        self._free_slots = free_slots
        self._on_job = on_job
        self._expires = expires
        self._tasks = tasks
        self._pullers: dict[str, Puller] = {}
        self._stopping = False
        self._directed: tuple[str, Waiting] | None = None

    @property
    def accepting(self) -> bool:
        """Whether a new queue may be pulled now (the jobs' group is open and no stop began)."""
        return not self._stopping and self._tasks.is_open

    @property
    def outstanding(self) -> int:
        """Jobs the server may still send here, over all queues."""
        return sum(p.outstanding for p in self._pullers.values())

    def start(self, consumer: str) -> Puller | None:
        """Pull from `consumer` until stopped; None (nothing started) once the worker stops or
        when `consumer` is pulled already."""
        if not self.accepting:
            return None
        puller = self._puller(
            consumer,
            self._shared_free,
            self._on_job,
            yielding=lambda: self._waiting() > 0,
            on_ended=lambda status: self._wake_directed(),
        )
        return self._run(consumer, puller)

    def start_shards(self, consumer: str, slots: Slots, *, on_shard: Callable[[Msg], None]) -> Puller | None:
        """Pull shards (schemas/shard.py) from `consumer`, one at a time, while a slot is free and
        the worker holds no shard's requests beyond its `slots` (pullshare.py has the rules;
        `on_shard` holds slots at once, and the rest a shard needs once decoded)."""
        if not self.accepting:
            return None

        def directed_short() -> bool:
            return self._waiting() > 0 and self._shared_free() <= 0

        def kept() -> int:
            return shard_kept(slots.beyond(), slots.paused, directed_short())

        def allowance() -> int:
            return shard_allowance(slots.free(), slots.beyond(), slots.paused, directed_short())

        puller = self._puller(
            consumer, allowance, on_shard, keep=kept, room=kept, on_ended=lambda status: self._wake_directed()
        )
        return self._run(consumer, puller)

    def _puller(
        self, consumer: str, free_slots: Callable[[], int], on_job: Callable[[Msg], None], **kw: Any
    ) -> Puller:
        """A puller of `consumer` holding `free_slots()` credit; a job it brings needs a free slot
        (unless `room` says otherwise)."""
        return Puller(
            self._nc,
            self._stream,
            consumer,
            free_slots=free_slots,
            on_job=on_job,
            **{"room": self._free_slots, "expires": self._expires, **kw},
        )

    def _shared_free(self) -> int:
        return shared_allowance(self._free_slots(), self._waiting(), self._directed_credit())

    def start_directed(
        self, consumer: str, waiting: Waiting, *, counted: Callable[[], None] = lambda: None
    ) -> Puller | None:
        """Pull this instance's directed queue, first whenever `waiting` says jobs wait there;
        `counted` is told of each job it brings."""
        if not self.accepting:
            return None

        def delivered(msg: Msg) -> None:
            waiting.delivered()
            counted()
            self._on_job(msg)

        def ended(status: str) -> None:
            if status in ("404", "408"):  # the pull found no more: the queue is empty
                waiting.empty()
                self.wake()

        puller = self._puller(
            consumer,
            lambda: directed_allowance(self._free_slots(), waiting.count, self._others_credit()),
            delivered,
            on_ended=ended,
            expires=min(DIRECTED_EXPIRES, self._expires),
        )
        started = self._run(consumer, puller)
        if started is not None:
            self._directed = (consumer, waiting)
        return started

    def _run(self, consumer: str, puller: Puller) -> Puller | None:
        """Only a tracked puller is stopped with the worker: a second one for the same consumer
        would keep taking jobs through a drain, so it is never started."""
        if consumer in self._pullers:
            log.warning("consumer %s is pulled already: no second puller started", consumer)
            return None
        self._pullers[consumer] = puller
        self._tasks.start_soon(supervised, f"the puller of {consumer}", puller.run)
        return puller

    def _waiting(self) -> int:
        return 0 if self._directed is None else self._directed[1].count

    def _directed_credit(self) -> int:
        puller = None if self._directed is None else self._pullers.get(self._directed[0])
        return 0 if puller is None else puller.outstanding

    def _others_credit(self) -> int:
        """The most credit any other puller holds (adapters' pullers may each hold all free slots)."""
        directed = None if self._directed is None else self._directed[0]
        return max((p.outstanding for c, p in self._pullers.items() if c != directed), default=0)

    def _wake_directed(self) -> None:
        """Another queue gave credit back: the directed puller may now have room."""
        if self._directed is not None and self._directed[1].count > 0:
            puller = self._pullers.get(self._directed[0])
            if puller is not None:
                puller.wake()

    def drop(self, consumer: str) -> None:
        """Stop pulling from one queue (an adapter was unloaded)."""
        puller = self._pullers.pop(consumer, None)
        if puller is not None:
            puller.stop()

    def wake(self) -> None:
        """A slot freed or the pause changed: every puller looks again."""
        for puller in self._pullers.values():
            puller.wake()

    def stop(self) -> None:
        self._stopping = True
        for puller in self._pullers.values():
            puller.stop()

    async def credit_returned(self) -> None:
        """Until no puller holds pull credit (after a pause): no job can be delivered here any more."""
        with anyio.move_on_after(self._expires + 2):
            while self.outstanding:
                await anyio.sleep(0.01)

    async def stopped(self) -> None:
        """Wait (briefly) until this worker can receive no more jobs, so a handed-back job goes elsewhere."""
        with anyio.move_on_after(self._expires + 2):
            for puller in list(self._pullers.values()):
                await puller.done.wait()
