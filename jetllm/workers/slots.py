"""How many jobs a worker holds, and the one rule every puller asks before it pulls.

A worker never holds more un-acked jobs than its slots: each of its pullers (its role's queue,
one per loaded adapter) asks `free()` before it pulls, and a job takes a slot the moment it is
delivered. Pausing (a sleep on its way) makes `free()` zero without touching the count. Whoever
must react when a slot frees or a pause ends (the pullers) listens here, so no part needs to
know which others hold the count.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio


class Slots:
    __slots__ = ("total", "busy", "paused", "_idle", "_listeners")

    def __init__(self, total: int) -> None:
        self.total = total
        self.busy = 0
        """Jobs held now: pulled and not yet settled."""
        self.paused = False
        self._idle = anyio.Event()
        self._listeners: list[Callable[[], None]] = []

    def free(self) -> int:
        return 0 if self.paused else max(self.total - self.busy, 0)

    def beyond(self) -> int:
        """Requests held beyond the slots: a shard's that wait in the engine's queue."""
        return max(self.busy - self.total, 0)

    def listen(self, on_change: Callable[[], None]) -> None:
        """Call `on_change` whenever a slot frees or the pause changes."""
        self._listeners.append(on_change)

    def take(self, n: int = 1) -> None:
        """A job (or `n` requests of a shard) now holds slots; a shard may take more than are free.
        A job's one slot was in its puller's credit already; a shard's others were in no credit, so
        the pullers are told, and one that now holds more credit than there are free slots gives it up."""
        self.busy += n
        if n > 1:
            self._changed()

    def release(self, n: int = 1) -> None:
        self.busy -= n
        if self.busy == 0:  # wakes every waiter (a sleep and a drain may wait at once)
            self._idle.set()
            self._idle = anyio.Event()
        self._changed()

    def pause(self, paused: bool) -> None:
        self.paused = paused
        self._changed()

    def _changed(self) -> None:
        for on_change in self._listeners:
            on_change()

    async def wait_idle(self, hand_back_after: float, hand_back: Callable[[], None]) -> None:
        """Until no job is held here; after `hand_back_after` seconds `hand_back()` ends the jobs
        still running (they settle by handing themselves back), and the wait goes on until they did."""
        with anyio.move_on_after(hand_back_after):
            while self.busy:
                await self._idle.wait()
        hand_back()
        while self.busy:
            await self._idle.wait()
