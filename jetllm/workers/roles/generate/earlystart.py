"""Starting the engine on a job while its request log is still being read.

Nearly every job is a first delivery whose log is empty. Waiting for the log lookup (a broker
round trip, slow when the box is busy) before the engine sees the prompt added that round trip to
every request's time to first token. The engine starts as soon as the prompt is rendered; its
token frames stay held until the worker has claimed the request, so the log still leads every
frame. When the log turns out not to be empty (a redelivery, a resumed or finished request) the
early start is stopped before it sent anything, and the job takes the usual path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

import anyio

from .... import taskdump
from ....aio import entered, owned_cancellation

T = TypeVar("T")


class Holds(Protocol):
    def hold(self) -> None: ...

    def release(self) -> None: ...


class EarlyStart(Generic[T]):
    def __init__(
        self, spawn: Callable[..., Any], frames: Holds, run: Callable[[Any], Awaitable[T]], name: str
    ) -> None:
        """`name`: the task's, for the task dump (taskdump.py)."""
        self._spawn = spawn
        self._name = name
        self._frames = frames
        self._run = run
        self._scope = anyio.CancelScope()
        self._done = anyio.Event()
        self._result: T | Exception | None = None
        self.started = False

    def start(self, prompt: Any) -> None:
        self.started = True
        self._frames.hold()
        self._spawn(self._main, prompt)

    async def _main(self, prompt: Any) -> None:
        taskdump.name_task(self._name)
        try:
            with entered(self._scope):
                try:
                    with owned_cancellation("the early start"):
                        self._result = await self._run(prompt)
                except Exception as exc:  # re-raised, unwrapped, by outcome()
                    self._result = exc
        finally:
            self._done.set()

    async def outcome(self) -> T:
        """Let its frames go (the request is claimed now) and wait for the engine to finish."""
        self._frames.release()
        await self._done.wait()
        if isinstance(self._result, Exception):
            raise self._result
        if self._result is None:
            raise RuntimeError("the early start was stopped before it finished")
        return self._result

    async def close(self) -> None:
        """Stop the engine's work if it still runs; nothing it held is ever sent."""
        if not self.started:
            return
        self._scope.cancel()
        with anyio.CancelScope(shield=True):
            await self._done.wait()
        self._frames.release()
        self.started = False
