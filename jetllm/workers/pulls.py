"""Every queue a worker pulls from, as one: its role's queue and one queue per loaded adapter.

The pullers share the worker's slots (whichever delivers first takes a slot), so they are woken
together when a slot frees, stopped together when the worker stops, and asked together whether
any still holds pull credit (a sleep must wait until none does) or can still receive a job (a
hand-back must wait until none can, or the job could come straight back here).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from .puller import Puller
from .tasks import JobTasks

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

    @property
    def accepting(self) -> bool:
        """Whether a new queue may be pulled now (the jobs' group is open and no stop began)."""
        return not self._stopping and self._tasks.is_open

    @property
    def outstanding(self) -> int:
        """Jobs the server may still send here, over all queues."""
        return sum(p.outstanding for p in self._pullers.values())

    def start(self, consumer: str) -> Puller | None:
        """Pull from `consumer` until stopped; None (nothing started) once the worker stops."""
        if not self.accepting:
            return None
        puller = Puller(
            self._nc,
            self._stream,
            consumer,
            free_slots=self._free_slots,
            on_job=self._on_job,
            expires=self._expires,
        )
        self._pullers[consumer] = puller
        self._tasks.start_soon(puller.run)
        return puller

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
