"""What a stuck process shows its operator on SIGUSR1: every task, and the chain of awaits down to
the frame it waits in, through coroutines, async generators and the future at the bottom."""

from __future__ import annotations

import logging
import os
import signal

import anyio
import pytest

from jetllm import taskdump

pytestmark = pytest.mark.anyio


async def _inner(ev: anyio.Event) -> None:
    await ev.wait()


async def _outer(ev: anyio.Event) -> None:
    await _inner(ev)


async def _tokens(ev: anyio.Event):
    await ev.wait()
    yield 1


async def _stream(ev: anyio.Event) -> None:
    taskdump.name_task("job r-7")
    async for _ in _tokens(ev):
        pass


@pytest.mark.parametrize(
    ("start", "task", "frames"),
    [
        (_outer, "_outer", ["_outer", "_inner", "Event.wait"]),
        (_stream, "job r-7", ["_stream", "_tokens", "Event.wait"]),  # through the generator's __anext__
    ],
)
async def test_each_task_shows_the_chain_of_awaits_down_to_what_it_waits_on(start, task, frames):
    ev = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(start, ev)
        await anyio.wait_all_tasks_blocked()
        dump = taskdump.dump_tasks()
        ev.set()
    line = next(x for x in dump.splitlines() if task in x.split(":")[0])
    names = [step.split(" (")[0] for step in line.split(": ", 1)[1].split(" > ")]
    at = [next(i for i, n in enumerate(names) if n.endswith(f)) for f in frames]
    assert at == sorted(at), f"not outermost first: {line}"
    assert "test_taskdump.py:" in line and "Future pending" in line.rsplit(" > ", 1)[1]


async def test_sigusr1_writes_the_dump_to_the_log_and_the_process_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger="jetllm.taskdump")
    ev = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_outer, ev)
        with taskdump.dump_on_signal():
            os.kill(os.getpid(), signal.SIGUSR1)
            with anyio.fail_after(5):
                while "tasks, each with what it awaits" not in caplog.text:
                    await anyio.sleep(0.01)
        ev.set()
    assert "_outer" in caplog.text and "_inner" in caplog.text
