"""What a stuck process shows its operator on SIGUSR1: every task, and the chain of awaits down to
the frame it waits in, through coroutines, async generators and the future at the bottom."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time

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
    assert "test_taskdump.py:" in line and line.rsplit(" > ", 1)[1] == "<Future pending>"


async def test_unnamed_tasks_waiting_alike_share_a_line_and_named_ones_keep_theirs():
    ev = anyio.Event()
    async with anyio.create_task_group() as tg:
        loop = asyncio.get_running_loop()
        unnamed = [loop.create_task(_inner(ev)) for _ in range(5)]  # asyncio's own names: Task-N
        tg.start_soon(_stream, ev)
        await anyio.wait_all_tasks_blocked()
        dump = taskdump.dump_tasks()
        ev.set()
        await asyncio.gather(*unnamed)
    inner = [x for x in dump.splitlines() if "_inner (" in x]
    assert len(inner) == 1 and inner[0].strip().startswith("5 tasks (Task-"), dump
    assert "test_taskdump.py:" in inner[0]
    assert sum(x.strip().startswith("job r-7:") for x in dump.splitlines()) == 1, dump


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


def test_a_worker_dumps_its_tasks_on_sigusr1_while_it_waits_for_nats_and_runs_on(tmp_path):
    """The dump is there from the worker's start, before any engine: here it waits for a NATS
    server that is not there, and the dump shows that wait."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "worker.log"
    cmd = [
        sys.executable,
        "-m",
        "jetllm",
        "worker",
        "--nats",
        f"nats://127.0.0.1:{port}",
        "--nats-wait",
        "120",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*cmd, "--model", str(tmp_path / "no-model")],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def wait_for(text: str) -> str:
        deadline = time.monotonic() + 60
        while text not in (got := log_path.read_text(errors="replace")):
            assert proc.poll() is None, f"the worker ended ({proc.returncode}):\n{got}"
            assert time.monotonic() < deadline, got
            time.sleep(0.05)
        return got

    try:
        wait_for("Connection refused")  # it is trying to connect
        proc.send_signal(signal.SIGUSR1)
        dump = wait_for("tasks, each with what it awaits")
        assert "run_worker" in dump and "connect" in dump.split("tasks, each with what it awaits", 1)[1]
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
