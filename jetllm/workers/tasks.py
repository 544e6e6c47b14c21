"""The task group a worker's jobs run in, handed to the parts that start work in it.

Jobs, background steps (an adapter's queues synced, its cache pruned) and
the pullers all run in one group that the serve loop opens once the worker serves and closes after
the drain; stopping waits for that group. Parts get this small handle instead of the group (or the
worker), and work offered while no group is open is refused (`start_soon`) or skipped (`spawn`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from ..aio import TaskGroup, contained


class JobTasks:
    __slots__ = ("_tg",)

    def __init__(self) -> None:
        self._tg: TaskGroup | None = None

    def open(self, tg: TaskGroup) -> None:
        self._tg = tg

    def close(self) -> None:
        self._tg = None

    @property
    def is_open(self) -> bool:
        return self._tg is not None

    def start_soon(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Start a task that has its own barrier (a job, a puller, an early start)."""
        if self._tg is None:
            raise RuntimeError("the jobs' task group is not open: the worker does not serve")
        self._tg.start_soon(fn, *args)

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start a background step whose failure is only logged; skipped when no group is open."""
        if self._tg is not None:
            self._tg.start_soon(contained, getattr(fn, "__qualname__", "a background step"), fn, *args)
