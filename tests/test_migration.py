"""Durability with the light engine in real worker processes, SIGKILLed at will (fast).

The fake engine's tokens depend only on the context, like greedy decoding, so a request that
continues on another worker must produce exactly the uninterrupted output.
The same properties against real vLLM workers are in test_vllm_chaos.py.
"""

from __future__ import annotations

import signal

import anyio
import pytest

from jetllm.errors import RequestFailed
from jetllm.producer import Client
from jetllm.producer.fleet import instance_status
from jetllm.schemas import (
    AcceptedFrame,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    SamplingOptions,
    StopConditions,
    TokensFrame,
)

from .jobs import consumer_counts, req, wait_dead_letter

pytestmark = pytest.mark.anyio


def expected_tokens(prompt: list[int], n: int, vocab: int = 97) -> list[int]:
    ctx = list(prompt)
    out = []
    for _ in range(n):
        t = sum(ctx) % vocab
        ctx.append(t)
        out.append(t)
    return out


async def start_ready(start_fake_worker, nats_url, namespace, *args):
    w = start_fake_worker(namespace, *args)
    await w.wait_ready(nats_url, timeout=30)
    return w


async def collect_until_kill(c: Client, request, worker_by_instance, kill_after_tokens: int):
    """Stream a request, SIGKILL the worker serving it after some tokens; return all frames."""
    frames = []
    tokens_seen = 0
    killed = set()
    current = None
    async for frame in c.generate(request):
        frames.append(frame)
        if isinstance(frame, AcceptedFrame):
            current = frame.worker
        if isinstance(frame, TokensFrame):
            tokens_seen += len(frame.token_ids)
            if tokens_seen >= kill_after_tokens and current not in killed and len(killed) == 0:
                killed.add(current)
                worker_by_instance[current].signal(signal.SIGKILL)
    return frames, killed


async def test_sigkill_mid_stream_continues_on_another_worker_without_gap_or_duplicate(
    nats_url, namespace, start_fake_worker
):
    a = await start_ready(start_fake_worker, nats_url, namespace, "--step-delay", "0.02")
    b = await start_ready(start_fake_worker, nats_url, namespace, "--step-delay", "0.02")
    workers = {a.instance: a, b.instance: b}
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=1.0) as c:
        prompt = [3, 1, 4]
        r = req("fake", prompt, max_tokens=120)
        frames, killed = await collect_until_kill(c, r, workers, kill_after_tokens=30)
    assert len(killed) == 1
    accepted = [f for f in frames if isinstance(f, AcceptedFrame)]
    assert [f.attempt for f in accepted] == [1, 2] and accepted[1].worker not in killed
    assert accepted[1].resumed_tokens >= 30
    seqs = [f.seq for f in frames if not isinstance(f, AcceptedFrame)]
    assert seqs == list(range(1, len(seqs) + 1))  # no gap, no duplicate
    tokens = [t for f in frames if isinstance(f, TokensFrame) for t in f.token_ids]
    assert tokens == expected_tokens(prompt, 120)
    final = frames[-1]
    assert isinstance(final, FinalFrame) and final.usage.completion_tokens == 120
    assert final.usage.prompt_tokens == 3


async def test_a_worker_killed_after_pulling_a_job_before_accepting_it_hands_it_on_at_once(
    nats_url, namespace, start_fake_worker
):
    """Its `pulled` frame names it: the producer's ping finds it gone and NAKs the delivery, long
    before the queue's ack_wait (60 s here) would."""
    stuck = await start_ready(
        start_fake_worker, nats_url, namespace, "--stuck-before-claim", "--ack-wait", "60"
    )
    result: list = []
    first = anyio.Event()
    async with Client(nats_url, namespace=namespace) as c:

        async def read() -> None:
            async for f in c.generate(req("fake", [3, 1, 4], max_tokens=5)):
                result.append(f)
                first.set()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                while (await instance_status(c.nc, c.names, stuck.instance)).in_flight == 0:
                    await anyio.sleep(0.05)
                assert not first.is_set()  # pulled, never accepted
                other = await start_ready(start_fake_worker, nats_url, namespace, "--ack-wait", "60")
                stuck.signal(signal.SIGKILL)
                with anyio.fail_after(15):
                    await first.wait()
    accepted = [f for f in result if isinstance(f, AcceptedFrame)]
    assert [(f.worker, f.attempt) for f in accepted] == [(other.instance, 2)]
    assert isinstance(result[-1], FinalFrame)
    assert [t for f in result if isinstance(f, TokensFrame) for t in f.token_ids] == expected_tokens(
        [3, 1, 4], 5
    )


async def test_tokens_not_yet_checkpointed_are_handed_over_by_the_producer(
    nats_url, namespace, start_fake_worker
):
    """With no checkpoint before the kill, the log holds no token: the worker taking over continues
    after exactly what the producer received, which only the producer could tell it."""
    args = ("--step-delay", "0.02", "--checkpoint-interval", "600")
    a = await start_ready(start_fake_worker, nats_url, namespace, *args)
    b = await start_ready(start_fake_worker, nats_url, namespace, *args)
    workers = {a.instance: a, b.instance: b}
    async with Client(nats_url, namespace=namespace) as c:
        prompt = [2, 7, 1]
        frames, killed = await collect_until_kill(c, req("fake", prompt, max_tokens=100), workers, 30)
    assert len(killed) == 1
    moved = next(i for i, f in enumerate(frames) if isinstance(f, AcceptedFrame) and f.attempt == 2)
    held = sum(len(f.token_ids) for f in frames[:moved] if isinstance(f, TokensFrame))
    assert frames[moved].resumed_tokens == held >= 30
    seqs = [f.seq for f in frames if not isinstance(f, AcceptedFrame)]
    assert seqs == list(range(1, len(seqs) + 1))
    assert [t for f in frames if isinstance(f, TokensFrame) for t in f.token_ids] == expected_tokens(
        prompt, 100
    )


async def test_a_frozen_worker_keeps_its_request_only_a_closed_connection_moves_it(
    nats_url, namespace, start_fake_worker
):
    """A worker frozen for longer than the producer's silence and ping timeouts (SIGSTOP: the worst a
    saturated CPU can do) answers no ping, but its connection stays open: the request is not moved,
    and it ends on that worker once it runs again."""
    a = await start_ready(start_fake_worker, nats_url, namespace, "--step-delay", "0.02")
    b = await start_ready(start_fake_worker, nats_url, namespace, "--step-delay", "0.02")
    workers = {a.instance: a, b.instance: b}

    async def freeze(worker) -> None:
        worker.signal(signal.SIGSTOP)
        try:
            await anyio.sleep(4)
        finally:
            worker.signal(signal.SIGCONT)

    async with Client(nats_url, namespace=namespace, heartbeat_timeout=1.0) as c:
        r = req("fake", [6, 1], max_tokens=100)
        frames: list = []
        tokens = 0
        async with anyio.create_task_group() as tg:
            async for frame in c.generate(r):
                frames.append(frame)
                if isinstance(frame, TokensFrame):
                    tokens += len(frame.token_ids)
                    if tokens >= 10 and tokens - len(frame.token_ids) < 10:  # once, while it streams
                        tg.start_soon(freeze, workers[frames[0].worker])
    accepted = [f for f in frames if isinstance(f, AcceptedFrame)]
    assert [f.attempt for f in accepted] == [1] and {f.attempt for f in frames} == {1}
    assert [t for f in frames if isinstance(f, TokensFrame) for t in f.token_ids] == expected_tokens(
        [6, 1], 100
    )
    assert isinstance(frames[-1], FinalFrame)


async def test_detached_job_migrates_and_its_result_is_stored(nats_url, namespace, start_fake_worker):
    a = await start_ready(start_fake_worker, nats_url, namespace, "--step-delay", "0.02", "--ack-wait", "2")
    async with Client(nats_url, namespace=namespace) as c:
        r = req("fake", [2, 7], max_tokens=150)
        await c.submit(r)  # nobody listens: a batch producer that went away
        with anyio.fail_after(20):
            while (await consumer_counts(c.nc, c.names, "fake"))[1] == 0:
                await anyio.sleep(0.02)
        await anyio.sleep(0.5)
        a.signal(signal.SIGKILL)
        await start_ready(start_fake_worker, nats_url, namespace, "--step-delay", "0.02", "--ack-wait", "2")
        result = await c.wait_result(r.request_id, timeout=60)
    assert result.final is not None and result.migrations == 1
    assert result.token_ids[0] == expected_tokens([2, 7], 150)


async def test_n_greater_than_one_refuses_to_migrate_once_tokens_were_delivered(
    nats_url, namespace, start_fake_worker
):
    a = await start_ready(start_fake_worker, nats_url, namespace, "--step-delay", "0.02")
    b = await start_ready(start_fake_worker, nats_url, namespace, "--step-delay", "0.02")
    workers = {a.instance: a, b.instance: b}
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=1.0) as c:
        r = req("fake", [5], max_tokens=200, sampling=SamplingOptions(n=2, temperature=1))
        frames, killed = await collect_until_kill(c, r, workers, kill_after_tokens=10)
    err = frames[-1]
    assert isinstance(err, ErrorFrame) and err.code == ErrorCode.NOT_MIGRATABLE
    assert "n=2" in err.message


async def test_a_job_that_kills_every_worker_is_dead_lettered_after_its_budget(
    nats_url, namespace, start_fake_worker
):
    workers = {}
    for _ in range(3):
        w = await start_ready(start_fake_worker, nats_url, namespace, "--step-delay", "0.05")
        workers[w.instance] = w
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=1.0) as c:
        r = req("fake", [9, 9], max_tokens=500, max_migrations=1)
        frames = []
        async for frame in c.generate(r):
            frames.append(frame)
            if isinstance(frame, AcceptedFrame):
                workers[frame.worker].signal(signal.SIGKILL)  # this job "crashes" whoever takes it
        dead = await wait_dead_letter(c.nc, c.names, lambda d: d.request_id == r.request_id)
    err = frames[-1]
    assert isinstance(err, ErrorFrame) and err.code == ErrorCode.MIGRATION_BUDGET_EXHAUSTED
    assert [f.attempt for f in frames if isinstance(f, AcceptedFrame)] == [1, 2]
    assert dead.code == ErrorCode.MIGRATION_BUDGET_EXHAUSTED and dead.deliveries == 3
    assert "2 times" in dead.reason and "budget is 1" in dead.reason


async def test_sigterm_with_a_short_grace_moves_requests_without_errors(
    nats_url, namespace, start_fake_worker
):
    first = await start_ready(
        start_fake_worker, nats_url, namespace, "--step-delay", "0.03", "--grace-period", "0.5"
    )
    async with Client(nats_url, namespace=namespace) as c:
        results = []

        async def one(i: int) -> None:
            results.append(await c.complete(req("fake", [i + 1], max_tokens=100)))

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
            with anyio.fail_after(20):
                while (await consumer_counts(c.nc, c.names, "fake"))[1] < 6:
                    await anyio.sleep(0.02)
            await anyio.sleep(0.3)
            first.signal(signal.SIGTERM)
            second = await start_ready(start_fake_worker, nats_url, namespace, "--step-delay", "0.01")
        code = await anyio.to_thread.run_sync(first.wait, 30)
    assert code == 0
    assert sorted(r.token_ids for r in results) == sorted(expected_tokens([i + 1], 100) for i in range(6))
    assert {r.worker for r in results} == {second.instance}  # every request finished on the second worker


async def test_a_job_cancelled_while_queued_is_never_run(nats_url, namespace, start_fake_worker):
    async with Client(nats_url, namespace=namespace) as c:
        queued = req("fake", max_tokens=5)
        await c.submit(queued)
        await c.cancel(queued.request_id, reason="changed my mind")
        w = await start_ready(start_fake_worker, nats_url, namespace)
        result = await c.wait_result(queued.request_id, timeout=20)
        assert result.error is not None and result.error.code == ErrorCode.CANCELLED
        assert "changed my mind" in result.error.message
        statuses = [
            s
            for s in await __import__("jetllm.producer.fleet", fromlist=["x"]).worker_statuses(c.nc, c.names)
        ]
        (status,) = [s for s in statuses if s.pid == w.proc.pid]
        assert status.extra["completed"] == "0" and status.extra["cancelled"] == "1"


async def test_the_same_request_id_twice_runs_once_and_both_get_the_result(
    nats_url, namespace, start_fake_worker
):
    await start_ready(start_fake_worker, nats_url, namespace, "--step-delay", "0.01")
    async with Client(nats_url, namespace=namespace) as c:
        r = req("fake", [4, 4], max_tokens=40)
        results = []

        async def one() -> None:
            results.append(await c.complete(r))

        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            tg.start_soon(one)
        again = await c.complete(r)  # after it finished
    assert [x.token_ids for x in results] == [expected_tokens([4, 4], 40)] * 2
    assert again.token_ids == results[0].token_ids


async def test_cancel_mid_stream_is_not_migrated(nats_url, namespace, start_fake_worker):
    await start_ready(start_fake_worker, nats_url, namespace, "--step-delay", "0.02")
    async with Client(nats_url, namespace=namespace) as c:
        r = req("fake", max_tokens=5000)
        async for frame in c.generate(r):
            if isinstance(frame, TokensFrame):
                break
        result = await c.wait_result(r.request_id, timeout=20)
    assert result.error is not None and result.error.code == ErrorCode.CANCELLED
    assert result.attempt == 1


async def test_errors_are_results_too(nats_url, namespace, start_fake_worker):
    await start_ready(start_fake_worker, nats_url, namespace)
    async with Client(nats_url, namespace=namespace) as c:
        bad = req("fake", [1], stop=StopConditions(max_tokens=10, min_tokens=20))
        with pytest.raises(RequestFailed):
            await c.complete(bad)
        result = await c.result(bad.request_id)
    assert result is not None and result.error.code == ErrorCode.INVALID_REQUEST
