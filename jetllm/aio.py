"""Running jetllm's async entry points (anyio on asyncio, with uvloop when it is installed),
task groups and cancel scopes that tell their own cancellations from a library's, keeping a
background task's failure its own, retrying a call that fails for a while, and calling one
function on many items a few at a time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import anyio

T = TypeVar("T")
log = logging.getLogger(__name__)


def run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    try:
        import uvloop  # noqa: F401

        opts = {"use_uvloop": True}
    except ImportError:
        opts = {}
    return anyio.run(fn, *args, backend="asyncio", backend_options=opts)


class StrayCancellation(Exception):
    """A task was cancelled by none of the cancel scopes it runs in."""


@contextlib.contextmanager
def owned_cancellation(what: str) -> Iterator[None]:
    """Let through only cancellations a cancel scope around this code asked for; raise any other
    as StrayCancellation.

    asyncio raises CancelledError in a task that awaits a future someone else cancelled (a library
    cancelling its own futures on a timeout, a reconnect or an unsubscribe). An anyio task group
    takes a child that ends so for a cancellation of its own and silently cancels every sibling:
    one job's mishap would end the worker with exit code 0. As an ordinary exception it meets the
    barrier of the job or step it happened in instead."""
    try:
        yield
    except anyio.get_cancelled_exc_class() as exc:
        if anyio.current_effective_deadline() == -math.inf or _cancelling() > 0:
            raise  # a scope around us was cancelled, or the task itself (nats-py ends its own so)
        raise StrayCancellation(
            f"{what} was cancelled by something other than its owner (a library cancelled a future it awaited)"
        ) from exc


@contextlib.contextmanager
def entered(scope: anyio.CancelScope) -> Iterator[anyio.CancelScope]:
    """`with scope:` that also takes as its own a cancellation that lost anyio's mark on the way.

    anyio knows its cancellations by their message. A library that catches one and raises a new
    CancelledError drops it (asyncio.gather, inside vLLM's prompt rendering, raises its last
    child's): the scope would let it through, and above it the task would look cancelled by
    nobody. Once this scope was cancelled (and no scope around it was), any cancellation leaving
    it is its own."""
    before = _cancelling()
    try:
        with scope:
            yield scope
    except anyio.get_cancelled_exc_class():
        if not scope.cancel_called or anyio.current_effective_deadline() == -math.inf:
            raise
        if _cancelling() > before:
            raise  # the task was cancelled besides (anyio takes back only its own requests)


@contextlib.contextmanager
def fail_after(seconds: float) -> Iterator[anyio.CancelScope]:
    """`anyio.fail_after` on `entered`: its deadline ends the body with TimeoutError even when a
    library re-raised the cancellation unmarked (an engine call, timed, would otherwise fail with
    StrayCancellation and say "internal" where "timed out" is the truth)."""
    scope = anyio.CancelScope(deadline=anyio.current_time() + seconds)
    interrupted = False
    with entered(scope):
        try:
            yield scope
        except anyio.get_cancelled_exc_class():
            interrupted = True
            raise
    if interrupted and anyio.current_time() >= scope.deadline:
        raise TimeoutError


def _cancelling() -> int:
    """How many cancellations of the current task are pending: anyio withdraws its own as its
    scopes end, so what is left was asked of the task itself (Task.cancel)."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


class TaskGroup:
    """anyio's task group, each child behind `owned_cancellation`: a child that a library
    cancelled fails with StrayCancellation, an exception its group and owner see and handle,
    instead of quietly cancelling its siblings. jetllm opens every task group through this one.
    (The body of the `async with` is not a child: a stray cancellation there goes on to the
    barrier around the block.)"""

    __slots__ = ("_tg",)

    def __init__(self) -> None:
        self._tg = anyio.create_task_group()

    @property
    def cancel_scope(self) -> anyio.CancelScope:
        return self._tg.cancel_scope

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any, name: object = None) -> None:
        self._tg.start_soon(_owned, fn, *args, name=name or getattr(fn, "__qualname__", None))

    async def __aenter__(self) -> TaskGroup:
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._tg.__aexit__(*exc_info)


async def _owned(fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
    with owned_cancellation(getattr(fn, "__qualname__", None) or "a task"):
        await fn(*args)


def task_group() -> TaskGroup:
    return TaskGroup()


async def supervised(
    what: str,
    fn: Callable[..., Awaitable[Any]],
    *args: Any,
    restart_after: float = 1.0,
    on_failure: Callable[[], Any] | None = None,
) -> None:
    """Run a long-lived companion task for its owner's whole life: a bug or a broken socket in it
    is logged with its traceback and the task starts again, instead of failing the owner's task
    group (which would end the process over one bad message)."""
    while True:
        try:
            with owned_cancellation(what):
                await fn(*args)
            return
        except Exception:
            log.exception("%s failed; starting it again in %.1fs", what, restart_after)
            if on_failure is not None:
                on_failure()
            await anyio.sleep(restart_after)


async def contained(what: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """Run a one-off step (a job's trace record, an adapter's cache pruning) whose failure must
    stay its own."""
    try:
        with owned_cancellation(what):
            await fn(*args)
    except Exception:
        log.exception("%s failed", what)


async def each(items: Iterable[T], fn: Callable[[T], Awaitable[Any]], at_once: int = 32) -> None:
    """`fn` on every item, `at_once` calls in flight: round trips overlap without a task per item
    (a batch may have 50,000 lines)."""
    todo = iter(items)

    async def worker() -> None:
        for item in todo:
            await fn(item)

    async with task_group() as tg:
        for _ in range(max(1, at_once)):
            tg.start_soon(worker)


def describe(exc: BaseException) -> str:
    """The first real cause inside task-group wrappers, as `Type: message`, for one log line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


def backoff(first: float, longest: float) -> Iterator[float]:
    """Pauses between attempts: `first`, then twice as long each time, never more than `longest`."""
    delay = first
    while True:
        yield delay
        delay = min(delay * 2, longest)


async def retried(
    call: Callable[[], Awaitable[T]],
    *,
    errors: tuple[type[BaseException], ...],
    within: float,
    what: str,
    first: float = 0.1,
    longest: float = 1.0,
) -> T:
    """`call()`, again after each failure of the kinds in `errors`, pausing twice as long each time
    (from `first` up to `longest`) for up to `within` seconds; then the last failure is raised.
    For calls that fail while a server restarts or a stream leader moves: there waiting is the fix."""
    deadline = time.monotonic() + within
    for delay in backoff(first, longest):
        try:
            return await call()
        except errors as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.info("%s failed (%s); retrying in %.1fs", what, type(exc).__name__, delay)
            await anyio.sleep(delay)
    raise AssertionError("unreachable")
