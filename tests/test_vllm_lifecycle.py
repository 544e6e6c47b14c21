"""Worker processes as an operator runs them: start after the jobs, SIGTERM, engine death."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import aclosing

import anyio
import nats.errors
import pytest

from jetllm.producer import Client
from jetllm.producer.completion import Completion, assemble
from jetllm.schemas import Frame, StopConditions, TokensFrame
from jetllm.workers.runtime import EXIT_ENGINE_DEAD

from .conftest import TINY
from .jobs import consumer_counts, req

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

LONG = 480  # tokens per request: the most the test worker's 512-token context holds after the prompt


async def test_queued_jobs_wait_for_a_worker_and_sigterm_drains_without_losing_any(
    nats_url, namespace, start_worker
):
    """Jobs published before any worker exists are served once one starts; SIGTERM with 8 requests
    in flight lets them finish, the job it had not started goes to a second worker, exit code 0."""
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=60) as c:
        results: dict[int, Completion] = {}
        streaming: set[int] = set()
        all_streaming = anyio.Event()

        async def watched(i: int, frames: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
            async for frame in frames:
                if isinstance(frame, TokensFrame) and i < 8 and i not in streaming:
                    streaming.add(i)
                    if len(streaming) == 8:
                        all_streaming.set()
                yield frame

        async def one(i: int, tokens: int) -> None:
            r = req(TINY, [10 + i, 20, 30], stop=StopConditions(max_tokens=tokens, ignore_eos=True))
            async with aclosing(c.generate(r)) as frames:
                results[i] = await assemble(r, watched(i, frames), 1)

        async def queued() -> int:
            return (await c.nc.jetstream().stream_info(c.names.jobs_stream)).state.messages

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, i, LONG)
            with anyio.fail_after(10):
                while await queued() < 8:
                    await anyio.sleep(0.02)
            tg.start_soon(one, 8, 20)
            with anyio.fail_after(10):
                while await queued() < 9:
                    await anyio.sleep(0.02)
            await anyio.sleep(0.5)
            assert results == {}  # nobody serves them yet; they wait in JetStream

            first = start_worker(namespace, "--slots", "8", "--grace-period", "120")
            # Tokens streaming for all 8 is the moment to stop it (the worker may finish them
            # before a status poll would even see it serving).
            try:
                with anyio.fail_after(240):
                    await all_streaming.wait()
            except TimeoutError:
                pytest.fail(f"8 requests never streamed: {sorted(streaming)}\n{first.log_tail()}")
            first.signal(signal.SIGTERM)
            second = start_worker(namespace, "--slots", "8")
            await second.wait_ready(nats_url)
            code = await anyio.to_thread.run_sync(first.wait, 180)
    assert code == 0, first.log_tail()
    assert sorted(results) == list(range(9))
    assert [len(results[i].token_ids) for i in range(8)] == [LONG] * 8
    assert len({results[i].worker for i in range(8)}) == 1  # the first worker finished them
    assert results[0].worker != second.instance
    assert results[8].worker == second.instance and len(results[8].token_ids) == 20


async def test_dead_engine_hands_jobs_back_and_the_worker_exits_nonzero(nats_url, namespace, start_worker):
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=60) as c:
        worker = start_worker(namespace, "--health-interval", "0.5", "--ack-wait", "300")
        await worker.wait_ready(nats_url)
        await c.submit(req(TINY, [5, 6, 7], stop=StopConditions(max_tokens=480, ignore_eos=True)))
        with anyio.fail_after(30):
            while (await consumer_counts(c.nc, c.names, TINY))[1] != 1:
                await anyio.sleep(0.02)
        for pid in worker.engine_pids():  # the EngineCore process (and with it the model worker)
            os.kill(pid, signal.SIGKILL)
        code = await anyio.to_thread.run_sync(worker.wait, 60)
        assert code == EXIT_ENGINE_DEAD, worker.log_tail()
        assert "engine is dead" in worker.log_tail(200)
        # ack_wait is 300 s: only an explicit hand-back lets a new worker run the job now
        survivor = start_worker(namespace)
        await survivor.wait_ready(nats_url)
        with anyio.fail_after(120):
            while (await c.nc.jetstream().stream_info(c.names.jobs_stream)).state.messages:
                await anyio.sleep(0.1)


async def test_a_worker_killed_alone_takes_its_engine_processes_with_it(nats_url, namespace, start_worker):
    """The OOM killer or `kill -9` hits the worker's pid only: vLLM's engine processes must not
    live on holding their memory (they did, before engine/lifetime.py)."""
    import psutil

    async with Client(nats_url, namespace=namespace, heartbeat_timeout=60) as c:
        worker = start_worker(namespace)
        await worker.wait_ready(nats_url)
        await c.submit(req(TINY, [5, 6, 7], stop=StopConditions(max_tokens=480, ignore_eos=True)))
        with anyio.fail_after(30):
            while (await consumer_counts(c.nc, c.names, TINY))[1] != 1:
                await anyio.sleep(0.02)
        engine = psutil.Process(worker.proc.pid).children(recursive=True)
        assert len(engine) >= 2, [p.name() for p in engine]  # EngineCore and its model runner
        os.kill(worker.proc.pid, signal.SIGKILL)
        # Its NATS connection dies with it, not with the engine processes it forked (reaped ~5 s
        # later): the server says "no responders" at once, which is how producers move its jobs.
        ping = c.names.instance_control(worker.instance, "ping")
        with anyio.fail_after(2):
            while True:
                try:
                    await c.nc.request(ping, b"", timeout=0.25)
                except nats.errors.NoRespondersError:
                    break
                except nats.errors.TimeoutError:
                    pass
                await anyio.sleep(0.05)
        _, alive = await anyio.to_thread.run_sync(lambda: psutil.wait_procs(engine, timeout=60))
        assert not alive, [(p.pid, p.name()) for p in alive]
