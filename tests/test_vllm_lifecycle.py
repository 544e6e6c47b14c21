"""Worker processes as an operator runs them: start after the jobs, SIGTERM, engine death, a kill,
a worker without metrics.

One test hands the fleet on from worker to worker (three engine start-ups where separate tests
took five): each phase's replacement is the next phase's subject."""

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
from jetllm.producer.registry import instances
from jetllm.schemas import Frame, LoadReport, StopConditions, TokensFrame
from jetllm.subjects import codec
from jetllm.workers.runtime import EXIT_ENGINE_DEAD

from .conftest import TINY, WorkerProcess
from .jobs import consumer_counts, req

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

LONG = 480  # tokens per request: the most the test worker's 512-token context holds after the prompt


async def test_drain_engine_death_and_a_lone_kill_each_hand_their_jobs_on(nats_url, namespace, start_worker):
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=60) as c:
        second = await queued_jobs_wait_for_a_worker_and_sigterm_drains_without_losing_any(
            c, nats_url, namespace, start_worker
        )
        survivor = await dead_engine_hands_jobs_back_and_the_worker_exits_nonzero(
            c, nats_url, namespace, start_worker, second
        )
        await a_worker_without_metrics_still_reports_its_engines_load(c, survivor)
        await a_worker_killed_alone_takes_its_engine_processes_with_it(c, survivor)


async def queued_jobs_wait_for_a_worker_and_sigterm_drains_without_losing_any(
    c: Client, nats_url: str, namespace: str, start_worker
) -> WorkerProcess:
    """Jobs published before any worker exists are served once one starts; SIGTERM with 8 requests
    in flight lets them finish, the job it had not started goes to a second worker, exit code 0.
    Which job waits is not fixed: a job the worker puts back for a moment (its request log slow to
    answer on a loaded box) lets the next one in first. Returns the second worker, started as the
    next phase needs it."""
    results: dict[int, Completion] = {}
    streaming: set[int] = set()
    all_streaming = anyio.Event()

    async def watched(i: int, frames: AsyncIterator[Frame]) -> AsyncIterator[Frame]:
        async for frame in frames:
            if isinstance(frame, TokensFrame) and i not in streaming and not all_streaming.is_set():
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
        # Tokens streaming for 8 of them is the moment to stop it (the worker may finish them
        # before a status poll would even see it serving).
        try:
            with anyio.fail_after(240):
                await all_streaming.wait()
        except TimeoutError:
            pytest.fail(f"8 requests never streamed: {sorted(streaming)}\n{first.log_tail()}")
        first.signal(signal.SIGTERM)
        (waiting,) = set(range(9)) - streaming
        # the next phase kills this one's engine: it checks health often, and jobs redeliver late
        second = start_worker(namespace, "--slots", "8", "--health-interval", "0.5", "--ack-wait", "3600")
        await second.wait_ready(nats_url)
        code = await anyio.to_thread.run_sync(first.wait, 180)
    assert code == 0, first.log_tail()
    assert sorted(results) == list(range(9))
    assert [len(results[i].token_ids) for i in range(9)] == [LONG] * 8 + [20]
    # the first worker finished the 8 it had started, and the second ran the one it had not
    (ran_first,) = {results[i].worker for i in streaming}
    assert ran_first != second.instance
    assert results[waiting].worker == second.instance, first.log_tail(200)
    return second


async def dead_engine_hands_jobs_back_and_the_worker_exits_nonzero(
    c: Client, nats_url: str, namespace: str, start_worker, worker: WorkerProcess
) -> WorkerProcess:
    """Returns the survivor, which ran the job handed back."""
    job = req(TINY, [5, 6, 7], stop=StopConditions(max_tokens=480, ignore_eos=True))
    await c.submit(job)
    with anyio.fail_after(30):
        while (await consumer_counts(c.nc, c.names, TINY))[1] != 1:
            await anyio.sleep(0.02)
    for pid in worker.engine_pids():  # the EngineCore process (and with it the model worker)
        os.kill(pid, signal.SIGKILL)
    code = await anyio.to_thread.run_sync(worker.wait, 60)
    assert code == EXIT_ENGINE_DEAD, worker.log_tail()
    assert "engine is dead" in worker.log_tail(200)
    # ack_wait is an hour (a worker starting sets the queue's): only an explicit hand-back lets a new
    # worker run the job now
    survivor = start_worker(namespace, "--ack-wait", "3600", "--no-metrics")
    await survivor.wait_ready(nats_url)
    with anyio.fail_after(120):
        while (await c.nc.jetstream().stream_info(c.names.jobs_stream)).state.messages:
            await anyio.sleep(0.1)
    result = await c.result(job.request_id)  # run to the end there, not dead-lettered
    assert result is not None and result.final is not None, result
    assert result.worker == survivor.instance and len(result.token_ids[0]) == 480
    return survivor


async def a_worker_without_metrics_still_reports_its_engines_load(c: Client, worker: WorkerProcess) -> None:
    """`--no-metrics` drops vLLM's Prometheus logger too, not the engine's statistics: what a
    router weighs (running, KV usage) still comes from the engine's scheduler."""
    (record,) = [r for r in await instances(c.js, c.names) if r.instance == worker.instance]
    assert record.metrics_url is None
    sub = await c.nc.subscribe(c.names.load(TINY, worker.instance))
    busy: list[LoadReport] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                c.complete, req(TINY, [8, 9, 10], stop=StopConditions(max_tokens=480, ignore_eos=True))
            )
            with anyio.fail_after(60):
                while not busy:
                    report = codec.Decoder(LoadReport).decode((await sub.next_msg(timeout=60)).data)
                    if report.running:
                        busy.append(report)
    finally:
        await sub.unsubscribe()
    assert busy[0].running == 1 and busy[0].kv_usage, busy[0]


def _socket_dirs(processes) -> set[str]:
    """The private directories (`jetllm-kv-*`, `jetllm-rpc-*`) of the Unix sockets these processes
    have open."""
    import psutil

    found = set()
    for process in processes:
        try:
            conns = process.net_connections("unix")
        except psutil.NoSuchProcess:
            continue
        for conn in conns:
            for path in (conn.laddr, conn.raddr):
                if isinstance(path, str) and os.path.basename(os.path.dirname(path)).startswith(
                    ("jetllm-kv-", "jetllm-rpc-")
                ):
                    found.add(os.path.dirname(path))
    return found


def _connected_to(process, port: int) -> bool:
    import psutil

    try:
        return any(conn.raddr and conn.raddr.port == port for conn in process.net_connections("tcp"))
    except psutil.NoSuchProcess:
        return False


async def a_worker_killed_alone_takes_its_engine_processes_with_it(c: Client, worker: WorkerProcess) -> None:
    """The OOM killer or `kill -9` hits the worker's pid only: vLLM's engine processes must not
    live on holding their memory (they did, before engine/lifetime.py), nor their sockets (vLLM's
    own and the KV-event ones) stay in the temporary directory (they did, before the watchdog
    removed them)."""
    import psutil

    await c.submit(req(TINY, [5, 6, 7], stop=StopConditions(max_tokens=480, ignore_eos=True)))
    with anyio.move_on_after(30) as waited:
        while (await consumer_counts(c.nc, c.names, TINY))[1] != 1:
            await anyio.sleep(0.02)
    assert not waited.cancelled_caught, f"the worker took no job in 30 s:\n{worker.log_tail(60)}"
    engine = psutil.Process(worker.proc.pid).children(recursive=True)
    assert len(engine) >= 2, [p.name() for p in engine]  # EngineCore and its model runner
    sockets = _socket_dirs([psutil.Process(worker.proc.pid), *engine])
    # KV events (the worker runs with --kv-events) and vLLM's own, each in a directory of the worker's
    assert {os.path.basename(d).split("-")[1] for d in sockets} == {"kv", "rpc"}, sockets
    os.kill(worker.proc.pid, signal.SIGKILL)
    # Its NATS connection dies with it, not with the engine processes it forked (reaped ~5 s
    # later): none of them holds a socket to the server, so the server says "no responders" as
    # soon as the kernel has closed the worker's, which is how producers move its jobs. (How soon
    # that is, is bench-chaos's measure: a 2 s bound here failed once on a loaded CI box.)
    port = c.nc.connected_url.port
    assert port is not None
    holding = [p.pid for p in engine if _connected_to(p, port)]
    assert not holding, f"engine processes {holding} hold a connection to the NATS server"
    ping = c.names.instance_control(worker.instance, "ping")
    with anyio.fail_after(30):
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
    with anyio.move_on_after(30):  # the watchdog removes them once the engine's processes are gone
        while any(os.path.exists(d) for d in sockets):
            await anyio.sleep(0.1)
    assert not [d for d in sockets if os.path.exists(d)], "the killed worker left its engine's sockets"
