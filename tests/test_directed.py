"""Directed jobs: addressed to one instance, as durable as shared ones, never stranded.

Pure rules as tables; then workers on the light engine: in this process where the test needs to
watch or stop a worker, as processes where one is SIGKILLed.
"""

from __future__ import annotations

import signal
import time
import uuid

import anyio
import nats.js.errors
import pytest

from jetllm.cli import main
from jetllm.producer import Client
from jetllm.producer.fleet import worker_statuses
from jetllm.producer.registry import instance
from jetllm.producer.traces import trace_records
from jetllm.schemas import AcceptedFrame, FinalFrame, InstanceRecord, SleepRequest, TraceRecord
from jetllm.subjects import codec
from jetllm.subjects.consumers import RETIRED_IDLE
from jetllm.subjects.directed import (
    DIRECTED_TO,
    MSG_ID,
    moved_headers,
    moved_msg_id,
    placement,
    queue_of,
    sweep_verdict,
)
from jetllm.subjects.handon import directed_backlog, move_to_shared
from jetllm.subjects.names import Names
from jetllm.subjects.policy import QueuePolicy
from jetllm.subjects.setup import ensure_streams
from jetllm.workers.pullshare import Waiting, directed_allowance, must_cancel, shared_allowance

from .conftest import inproc_worker
from .fake_engine import FakeEngine
from .jobs import req

N = Names("t")
NOW = 1000.0


def record(**kw) -> InstanceRecord:
    fields = dict(
        instance="w1",
        role="generate",
        model="fake",
        state="serving",
        heartbeat_at=NOW - 1,
        expires_after=6.0,
        directed_queue="generate",
    )
    return InstanceRecord(**{**fields, **kw})


# -- pure rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "free, waiting, others, allowed",
    [
        (4, 0, 0, 0),  # nothing heard: no directed pull
        (4, 1, 0, 1),  # one heard: ask for one
        (4, 9, 0, 4),  # more than the free slots: all of them
        (4, 2, 3, 1),  # another queue still holds credit: only what it leaves
        (0, 2, 0, 0),  # busy: they wait in JetStream
        (1, 2, 4, 0),  # credit over free slots (adapters' pullers overlap): nothing
    ],
)
def test_directed_allowance(free, waiting, others, allowed):
    assert directed_allowance(free, waiting, others) == allowed


@pytest.mark.parametrize(
    "free, waiting, directed, allowed",
    [
        (4, 0, 0, 4),  # no directed job: every free slot
        (4, 1, 0, 3),  # one waits: its slot is kept for it
        (4, 1, 1, 3),  # it was asked for: counted once
        (4, 0, 2, 2),  # a directed pull still holds credit
        (1, 1, 0, 0),  # one slot, a directed job waits: it goes first
        (0, 0, 0, 0),
    ],
)
def test_shared_allowance(free, waiting, directed, allowed):
    assert shared_allowance(free, waiting, directed) == allowed


@pytest.mark.parametrize(
    "outstanding, allowance, waiting, cancel",
    [
        (0, 0, False, False),  # nothing held
        (3, 0, False, True),  # paused or the slots went elsewhere
        (3, 2, False, False),  # more than allowed, nobody waits: let it be (adapters' overlap)
        (3, 2, True, True),  # directed jobs wait for slots it holds
        (2, 2, True, False),  # it holds only what it may
    ],
)
def test_must_cancel(outstanding, allowance, waiting, cancel):
    assert must_cancel(outstanding, allowance, waiting) is cancel


def test_waiting_counts_heard_and_delivered_jobs_and_trusts_an_empty_pull():
    w = Waiting()
    w.heard()
    w.heard()
    w.delivered()
    assert w.count == 1
    w.empty()
    w.delivered()
    assert w.count == 0
    w.reported(3)
    w.reported(1)
    assert w.count == 3


@pytest.mark.parametrize(
    "rec, queue, model, why",
    [
        (record(), "generate", "fake", None),
        (record(role="decode"), "generate", "fake", None),  # decode workers pull the generate queue
        (None, "generate", "fake", "not in the registry"),
        (record(heartbeat_at=NOW - 7), "generate", "fake", "its registry record expired"),
        (record(), "generate", "other", "it serves 'fake', not 'other'"),
        (record(state="draining"), "generate", "fake", "it is draining"),
        (record(state="sleeping"), "generate", "fake", "it is sleeping"),
        (
            record(role="prefill", directed_queue="prefill"),
            "generate",
            "fake",
            "it pulls no directed generate jobs",
        ),
        (
            record(directed_queue=None),
            "generate",
            "fake",
            "it pulls no directed generate jobs",
        ),  # an older worker
    ],
)
def test_placement(rec, queue, model, why):
    assert placement(rec, queue, model, NOW) == why


@pytest.mark.parametrize(
    "instance, rec, verdict",
    [
        ("me", record(instance="me"), "skip"),  # its own: handed on when it stops
        ("me", None, "skip"),
        ("w1", None, "move"),  # stopped cleanly (record removed), or aged out
        ("w1", record(heartbeat_at=NOW - 7), "move"),  # SIGKILLed: heartbeat too old
        ("w1", record(), "ping"),  # looks alive: its connection decides
    ],
)
def test_sweep_verdict(instance, rec, verdict):
    assert sweep_verdict(instance, "me", rec, NOW) == verdict


def test_a_moved_job_has_a_new_id_every_mover_agrees_on_and_names_its_instance():
    headers = {MSG_ID: "r-1", "Content-Type": "application/msgpack", "Nats-Expected-Stream": "X"}
    moved = moved_headers(headers, 42, "w1")
    assert moved == {
        MSG_ID: "r-1~moved~42",
        "Content-Type": "application/msgpack",
        DIRECTED_TO: "w1",
    }
    assert moved_msg_id("r-1", 42) == moved_headers(headers, 42, "w2")[MSG_ID] != moved_msg_id("r-1", 43)
    assert moved_msg_id(None, 7) == "job~moved~7"


@pytest.mark.parametrize(
    "subject, headers, queue",
    [
        (N.jobs("generate", "Qwen/Qwen3-0.6B"), None, "shared"),
        (N.directed_jobs("generate", "Qwen/Qwen3-0.6B", "host-1.a"), None, "directed"),
        (N.jobs("generate", "m"), {DIRECTED_TO: "w1"}, "moved from w1"),
        (N.jobs("generate", "m"), {DIRECTED_TO: "w" * 5000}, "moved from " + "w" * 128),
    ],
)
def test_queue_of(subject, headers, queue):
    assert queue_of(N, subject, headers) == queue


@pytest.mark.parametrize(
    "subject, parsed",
    [
        (
            N.directed_jobs("generate", "Qwen/Qwen3-0.6B", "host-1.a"),
            ("generate", "Qwen/Qwen3-0.6B", "host-1.a"),
        ),
        (N.jobs("generate", "m"), None),
        (N.jobs("generate", "m") + ".x.w1", None),
        (Names("u").directed_jobs("generate", "m", "w1"), None),
        (N.jobs("generate", "m") + ".i.bad token", None),
        (N.directed_jobs("generate", "m", "w1").replace(".generate.", ".Not_A-Role."), None),
    ],
)
def test_parse_directed(subject, parsed):
    assert N.parse_directed(subject) == parsed


# -- the message plane --------------------------------------------------------------------------

pytestmark = pytest.mark.anyio


async def traces_of(client: Client, request_id: str, timeout: float = 10.0) -> list[TraceRecord]:
    with anyio.fail_after(timeout):
        while True:
            records = await trace_records(client.js, client.names, request_id)
            if records and records[-1].outcome == "completed":
                return records
            await anyio.sleep(0.1)


async def run(client: Client, request, instance: str | None = None) -> list:
    with anyio.fail_after(30):
        return [f async for f in client.generate(request, instance=instance)]


def accepted_by(frames) -> list[str]:
    return [f.worker for f in frames if isinstance(f, AcceptedFrame)]


async def test_a_directed_job_runs_on_its_instance_and_the_trace_says_so(nats_url, namespace, client):
    async with (
        inproc_worker(nats_url, FakeEngine(), namespace=namespace, instance="wa") as a,
        inproc_worker(nats_url, FakeEngine(), namespace=namespace, instance="wb"),
    ):
        for target in ("wa", "wb", "wa", "wb"):
            r = req("fake", [1, 2, 3])
            frames = await run(client, r, instance=target)
            assert accepted_by(frames) == [target] and isinstance(frames[-1], FinalFrame)
            assert [t.queue for t in await traces_of(client, r.request_id)] == ["directed"]
        shared = req("fake")
        await run(client, shared)
        assert [t.queue for t in await traces_of(client, shared.request_id)] == ["shared"]
        # an instance that is not there: the job goes to the shared queue at once
        lost = req("fake")
        frames = await run(client, lost, instance="nobody")
        assert accepted_by(frames)[0] in ("wa", "wb")
        assert [t.queue for t in await traces_of(client, lost.request_id)] == ["shared"]
        assert a.directed.waiting.count == 0
        assert a.counters.directed == 2


async def test_directed_jobs_wait_for_their_busy_instance_and_go_first(nats_url, namespace, client):
    """wa has one slot, busy with a long directed job; a second directed job waits for it while wb
    takes the shared jobs; when wa's slot frees, the directed job goes before the shared ones."""
    async with (
        inproc_worker(nats_url, FakeEngine(step_delay=0.02), namespace=namespace, instance="wa", slots=1),
        inproc_worker(nats_url, FakeEngine(step_delay=0.02), namespace=namespace, instance="wb", slots=1),
    ):
        long_job = req("fake", max_tokens=40)  # ~0.8 s
        waits = req("fake", max_tokens=2)
        shared = [req("fake", max_tokens=10) for _ in range(6)]
        order: list[tuple[str, str]] = []

        async def one(r, instance=None):
            frames = await run(client, r, instance)
            order.append((accepted_by(frames)[0], r.request_id))

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, long_job, "wa")
            await anyio.sleep(0.2)
            tg.start_soon(one, waits, "wa")
            await anyio.sleep(0.05)
            for r in shared:
                tg.start_soon(one, r)
        on = dict((rid, w) for w, rid in order)
        assert on[long_job.request_id] == on[waits.request_id] == "wa"
        assert "wb" in {on[r.request_id] for r in shared}
        traces = {r.request_id: (await traces_of(client, r.request_id))[0] for r in [waits, *shared]}
        on_wa = sorted((t.pulled_at, rid) for rid, t in traces.items() if t.instance == "wa")
        assert on_wa[0][1] == waits.request_id  # first job wa took after the long one: the directed one


async def test_a_stopping_worker_hands_its_directed_jobs_on(nats_url, namespace, client):
    async with inproc_worker(nats_url, FakeEngine(step_delay=0.02), namespace=namespace, instance="wb"):
        async with inproc_worker(
            nats_url,
            FakeEngine(step_delay=0.02),
            namespace=namespace,
            instance="wa",
            slots=1,
            grace_period=0.2,
        ) as a:
            jobs = [req("fake", max_tokens=60) for _ in range(3)]
            results: dict[str, list] = {}

            async def one(r):
                results[r.request_id] = await run(client, r, "wa")

            async with anyio.create_task_group() as tg:
                for r in jobs:
                    tg.start_soon(one, r)
                with anyio.fail_after(10):
                    while not a.running:  # the first started; the other two wait for wa
                        await anyio.sleep(0.01)
                await anyio.sleep(0.2)
                a.stop()
        try:  # its consumer is retired: the server removes it once idle this long
            consumer = await client.js.consumer_info(client.names.jobs_stream, a.directed.consumer)
            assert consumer.config.inactive_threshold == RETIRED_IDLE
        except nats.js.errors.NotFoundError:
            pass  # removed already
        for r in jobs:
            frames = results[r.request_id]
            assert isinstance(frames[-1], FinalFrame) and accepted_by(frames)[-1] == "wb"
            assert [f for f in frames if isinstance(f, FinalFrame)] == [frames[-1]]
        assert a.directed.moved_out == a.counters.moved == 3  # the started one (handed back) and two waiting
        hops = {r.request_id: await traces_of(client, r.request_id) for r in jobs}
        assert sorted(h[-1].queue for h in hops.values()) == ["moved from wa"] * 3
        assert await directed_backlog(client.js, client.names) == {}


async def test_two_movers_at_once_queue_each_job_once(nats_url, namespace):
    names = Names(namespace)
    async with Client(nats_url, namespace=namespace) as c:
        await ensure_streams(c.js, names, QueuePolicy())
        subject = names.directed_jobs("generate", "fake", "gone")
        for i in range(20):
            await c.js.publish(subject, b"job", headers={MSG_ID: f"r-{i}"})
        moved = [0, 0]

        async def mover(i):
            moved[i] = await move_to_shared(c.js, names, subject)

        async with anyio.create_task_group() as tg:
            tg.start_soon(mover, 0)
            tg.start_soon(mover, 1)
        assert sum(moved) == 20
        info = await c.js.stream_info(names.jobs_stream, subjects_filter=">")
        assert info.state.subjects == {names.jobs("generate", "fake"): 20}


async def test_a_killed_workers_directed_jobs_complete_elsewhere_exactly_once(
    nats_url, namespace, start_fake_worker
):
    """Jobs addressed to a worker that is SIGKILLed, published before and after its death, all end
    on the two survivors (both sweeping), each with one final frame and one completed hop."""
    a, b, c = (start_fake_worker(namespace, "--slots", "1", "--step-delay", "0.02") for _ in range(3))
    for w in (a, b, c):
        await w.wait_ready(nats_url, timeout=30)
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=1.0) as client:
        results: dict[str, list] = {}
        jobs = [req("fake", max_tokens=40) for _ in range(6)]
        started = anyio.Event()

        async def one(r):
            frames = results[r.request_id] = []
            with anyio.fail_after(60):
                async for f in client.generate(r, instance=a.instance):
                    frames.append(f)
                    if isinstance(f, AcceptedFrame) and f.worker == a.instance:
                        started.set()

        async with anyio.create_task_group() as tg:
            for r in jobs[:4]:
                tg.start_soon(one, r)
            with anyio.fail_after(10):
                await started.wait()  # one runs on a, three wait for it
            await anyio.sleep(0.3)
            a.signal(signal.SIGKILL)
            killed_at = time.monotonic()
            for r in jobs[4:]:  # its record still looks alive for seconds: published directed
                tg.start_soon(one, r)
        for r in jobs:
            frames = results[r.request_id]
            assert isinstance(frames[-1], FinalFrame), frames[-1]
            assert len([f for f in frames if isinstance(f, FinalFrame)]) == 1
            assert accepted_by(frames)[-1] in (b.instance, c.instance)
            hops = await traces_of(client, r.request_id)
            assert [h.outcome for h in hops if h.outcome == "completed"] == ["completed"]
            assert hops[-1].queue == f"moved from {a.instance}"  # directed to a, moved by a sweeper
        assert time.monotonic() - killed_at < 30
        assert await directed_backlog(client.js, client.names) == {}
        statuses = await worker_statuses(client.nc, client.names, 0.5)
        assert sum(int(s.extra["moved"]) for s in statuses) == len(jobs)  # two sweepers, each job moved once


async def test_a_sleeping_worker_hands_its_directed_jobs_on_and_new_ones_go_shared(
    nats_url, namespace, client
):
    async with (
        inproc_worker(nats_url, FakeEngine(), namespace=namespace, instance="wa", registry_interval=0.3) as a,
        inproc_worker(nats_url, FakeEngine(), namespace=namespace, instance="wb"),
    ):
        await a.engine_control.sleep(SleepRequest(level=1))
        with anyio.fail_after(5):  # the registry says so: new jobs for wa go to the shared queue
            while (
                await instance(await client.js.key_value(client.names.registry_bucket), client.names, "wa")
            ).state != "sleeping":
                await anyio.sleep(0.05)
        frames = await run(client, req("fake"), instance="wa")
        assert accepted_by(frames) == ["wb"]
        # one published for wa just before it slept (a router's stale view) is handed on
        late = req("fake")
        await client.js.publish(
            client.names.directed_jobs("generate", "fake", "wa"),
            codec.encode(late),
            headers={MSG_ID: late.request_id},
        )
        result = await client.wait_result(late.request_id, timeout=10)
        assert result.error is None
        assert [(t.instance, t.queue) for t in await traces_of(client, late.request_id)] == [
            ("wb", "moved from wa")
        ]


async def test_jetllm_generate_addresses_an_instance_and_jetllm_trace_says_so(
    nats_url, namespace, start_fake_worker, capsys
):
    """The trace, not the worker (there is one), shows that the job went directed."""
    worker = start_fake_worker(namespace)
    target = await worker.wait_ready(nats_url, timeout=30)
    rid = f"r-{uuid.uuid4().hex}"

    def cli(*args: str) -> int:  # the commands in a thread: each runs its own event loop
        return main([args[0], "--nats", nats_url, "--namespace", namespace, *args[1:]])

    generate = ("generate", "--model", "fake", "--tokens", "1,2,3", "--max-tokens", "3", "--request-id", rid)
    assert await anyio.to_thread.run_sync(lambda: cli(*generate, "--instance", target)) == 0
    assert f"[accepted by {target}]" in capsys.readouterr().err
    assert await anyio.to_thread.run_sync(lambda: cli("trace", rid)) == 0
    shown = capsys.readouterr().out
    assert f"pulled by {target}" in shown and "from the directed queue" in shown, shown


async def test_a_directed_subject_with_a_bad_role_does_not_stop_the_sweep(nats_url, namespace):
    """Producers may publish anywhere under `jobs.>`: a job on `jobs.<not a role>.<model>.i.<x>`
    is left where it is, and the directed jobs of gone instances still move."""
    names = Names(namespace)
    async with inproc_worker(nats_url, FakeEngine(), namespace=namespace, instance="wa") as w:
        poison = names.directed_jobs("generate", "fake", "gone").replace(".generate.", ".Not_A-Role.")
        await w.ctx.js.publish(poison, b"job", headers={MSG_ID: "poison"})
        await w.ctx.js.publish(
            names.directed_jobs("generate", "fake", "gone"), b"job", headers={MSG_ID: "r-1"}
        )
        assert await w.sweeper.sweep() == 1
        assert await w.sweeper.sweep() == 0
