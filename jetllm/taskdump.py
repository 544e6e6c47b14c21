"""Where every task of this process is waiting, written to the log on SIGUSR1.

A worker that stops making progress without failing (a request that will not end, a drain that
never finishes) writes nothing about it, and Python's faulthandler shows threads, where all of the
event loop's tasks are one thread parked in its selector. This follows each task's chain of awaits
down to the innermost frame, through coroutines and async generators, while the loop runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
import signal
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

_MAX_DEPTH = 64
_UNNAMED = re.compile(r"Task-\d+")  # asyncio's default name


def name_task(name: str) -> None:
    """Names the running task for the dump (a job's task by its request id); outside a task, nothing."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return
    if task is not None:
        task.set_name(name)


def await_chain(awaitable: Any) -> list[str]:
    """The frames from `awaitable` (a task's coroutine) down to what it waits on, outermost first.

    A coroutine waiting on an async generator's `__anext__` holds an object that does not name the
    generator; the garbage collector's referents do."""
    chain: list[str] = []
    for _ in range(_MAX_DEPTH):
        if awaitable is None:
            break
        frame = _frame_of(awaitable)
        if frame is not None:
            code = frame.f_code
            chain.append(f"{code.co_qualname} ({_short(code.co_filename)}:{frame.f_lineno})")
        inner = _awaited_by(awaitable)
        if inner is None and frame is None:
            chain.append(_describe(awaitable))
        awaitable = inner
    return chain


def all_tasks() -> list[tuple[str, list[str]]]:
    """Every task of the running loop, by name: its name and its chain of awaits."""
    tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    return [(task.get_name(), await_chain(task.get_coro())) for task in tasks]


def dump_tasks() -> str:
    """Every task of the running loop, one line each: its name, then its chain of awaits.

    Unnamed tasks that wait at the same place (a connection's two dozen subscriptions) share one
    line, so what is unusual is not pushed out of a short log excerpt by what is not."""
    tasks = all_tasks()
    lines = [f"{len(tasks)} tasks, each with what it awaits (outermost first):"]
    alike: dict[tuple[str, ...], list[str]] = {}
    for name, chain in tasks:
        if _UNNAMED.fullmatch(name):
            alike.setdefault(tuple(chain), []).append(name)
        else:
            lines.append(f"  {name}: " + " > ".join(chain))
    for steps, names in alike.items():
        who = names[0] if len(names) == 1 else f"{len(names)} tasks ({', '.join(names)})"
        lines.append(f"  {who}: " + " > ".join(steps))
    return "\n".join(lines)


def log_tasks() -> None:
    log.warning("%s", dump_tasks())


def _frame_of(obj: Any) -> Any:
    for attr in ("cr_frame", "ag_frame", "gi_frame"):
        frame = getattr(obj, attr, None)
        if frame is not None:
            return frame
    return None


def _awaited_by(obj: Any) -> Any:
    for attr in ("cr_await", "ag_await", "gi_yieldfrom"):
        if hasattr(obj, attr):
            return getattr(obj, attr)
    kind = type(obj).__name__
    if kind in ("async_generator_asend", "async_generator_athrow"):
        return next((r for r in gc.get_referents(obj) if hasattr(r, "ag_frame")), None)
    return None


def _describe(obj: Any) -> str:
    """A leaf that is not a frame: the future a coroutine waits on, by its type and state only
    (a future's repr shows its callbacks' arguments, which the log has no business holding)."""
    future = next((r for r in gc.get_referents(obj) if isinstance(r, asyncio.Future)), None)
    if future is None:
        return f"<{type(obj).__name__}>"
    state = "cancelled" if future.cancelled() else "done" if future.done() else "pending"
    return f"<{type(future).__name__} {state}>"


def _short(filename: str) -> str:
    parts = filename.replace("\\", "/").split("/")
    for root in ("site-packages", "jetllm", "tests"):
        if root in parts:
            i = len(parts) - 1 - parts[::-1].index(root)
            return "/".join(parts[i + (root == "site-packages") :])
    return "/".join(parts[-2:])


def ignore_until_ready() -> None:
    """From a command's start: SIGUSR1 is ignored until the loop can answer it, not the end of the
    process (its default). Only this process's: the engine's processes, started once the handler
    is in place, keep the default, so the signal goes to the worker's pid, not its group."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


@contextlib.contextmanager
def dump_on_signal() -> Iterator[None]:
    """While open, each SIGUSR1 writes the dump to the log; then SIGUSR1 is handled as before.
    A plain handler on the running loop, not a task: it changes nothing about how the body ends."""
    loop = asyncio.get_running_loop()
    before = signal.getsignal(signal.SIGUSR1)
    loop.add_signal_handler(signal.SIGUSR1, log_tasks)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)
        signal.signal(signal.SIGUSR1, before)
