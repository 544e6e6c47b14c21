"""The router on the message plane, with a fleet made of registry records and KV events published
by the test (no engine): placement and its trace, a warm start from the stream, a gap and its
resync, and a router fleet placing every job of the routing queue exactly once."""

from __future__ import annotations

import time

import anyio
import pytest

from jetllm.producer import Client
from jetllm.producer.traces import trace_records
from jetllm.router import Router, publish_directed
from jetllm.router.metrics import RouterCollector
from jetllm.router.service import bind, serve
from jetllm.router.trace import route_lines
from jetllm.schemas import (
    EngineInfo,
    GenerateRequest,
    InstanceRecord,
    KvCleared,
    KvEventBatch,
    KvResync,
    KvStored,
    LoadReport,
)
from jetllm.subjects import codec
from jetllm.subjects.names import Names
from jetllm.subjects.policy import QueuePolicy
from jetllm.subjects.setup import ensure_kv_events_stream, ensure_registry

from .jobs import req

pytestmark = pytest.mark.anyio

MODEL = "m"
B = 4
A = list(range(100, 118))  # 4 full blocks and 2 tokens: 16 tokens can be cached
COLD = list(range(300, 318))
_jobs = codec.Decoder(GenerateRequest)


def stored(tokens: list[int]) -> KvStored:
    from jetllm.router.hashing import BlockHasher

    full = len(tokens) // B * B
    return KvStored(block_hashes=BlockHasher(B).chain(tokens), token_ids=tokens[:full], block_size=B)


async def register(js, names: Names, *instances: str) -> None:
    kv = await ensure_registry(js, names)
    now = time.time()
    for inst in instances:
        record = InstanceRecord(
            instance=inst,
            role="generate",
            model=MODEL,
            state="serving",
            ready=True,
            slots=8,
            engine=EngineInfo(block_size=B),
            heartbeat_at=now,
            expires_after=600,
        )
        await kv.put(names.instance_key(inst), codec.encode(record))


async def kv_batch(js, names: Names, inst: str, seq: int, events, resync: KvResync | None = None) -> None:
    batch = KvEventBatch(instance=inst, model=MODEL, seq=seq, events=events, resync=resync)
    await js.publish(names.kv_events(MODEL, inst), codec.encode(batch), stream=names.kv_events_stream)


async def eventually(check, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not check():
            await anyio.sleep(0.05)


async def stored_jobs(js, names: Names) -> list[tuple[str, str]]:
    """(subject, request id) of every job in the jobs stream (nothing consumes them here)."""
    state = (await js.stream_info(names.jobs_stream)).state
    out = []
    for seq in range(state.first_seq, state.last_seq + 1):
        msg = await js.get_msg(names.jobs_stream, seq)
        out.append((msg.subject, _jobs.decode(msg.data).request_id))
    return out


async def test_a_client_router_addresses_jobs_to_the_holder_of_their_prefix_and_traces_why(
    nats_url, namespace
):
    async with Client(nats_url, namespace=namespace) as setup:
        names, js = setup.names, setup.js
        await register(js, names, "w1", "w2")
        await ensure_kv_events_stream(js, names, QueuePolicy())
        await kv_batch(js, names, "w1", 1, [stored(A)])
        seen: list[tuple[str, str | None]] = []

        async def saw(msg) -> None:
            seen.append((msg.subject, (msg.headers or {}).get("Nats-Msg-Id")))

        await setup.nc.subscribe(f"{names.jobs('generate', MODEL)}.>", cb=saw)
        await setup.nc.subscribe(names.jobs("generate", MODEL), cb=saw)

        router = Router(MODEL, name="r1")
        async with Client(nats_url, namespace=namespace, router=router) as c:
            await eventually(lambda: len(router.instances) == 2)
            hot = req(MODEL, A, session_id="s1")
            cold = req(MODEL, COLD)
            await c.submit(hot)
            await c.submit(cold)
            await eventually(lambda: len(seen) == 2)
            home = seen[1][0].rsplit(".", 1)[-1]  # a prompt no one holds goes to its home
            assert seen == [
                (names.directed_jobs("generate", MODEL, "w1"), hot.request_id),
                (names.directed_jobs("generate", MODEL, home), cold.request_id),
            ]
            assert router.stats.decisions == 2 and router.stats.directed == 2
            assert router.stats.hit_rate == pytest.approx(16 / 36)
            exported = {m.name: m for m in RouterCollector(router).collect()}
            assert exported["jetllm_router_hit_rate"].samples[0].value == pytest.approx(16 / 36)
            reasons = {x.labels["reason"]: x.value for x in exported["jetllm_router_decisions"].samples}
            assert reasons == {"cached prefix": 1, "prompt's home": 1}
            assert exported["jetllm_router_kv_events_skipped"].samples[0].value == 0
        assert not router.started  # the client started it, the client stopped it

        (rec,) = await trace_records(js, names, hot.request_id)
        assert rec.hop == "router" and rec.instance == "r1" and rec.outcome == "directed"
        route = rec.route
        assert route.chosen == "w1" and route.expected_cached_tokens == 16 and route.prompt_tokens == 18
        assert [x.instance for x in route.candidates] == ["w1", "w2"]
        assert [x.cached_tokens for x in route.candidates] == [16, 0]
        assert route.why.startswith("16/18 prompt tokens cached")
        lines = route_lines(rec)  # as `jetllm trace` shows it
        assert lines[0].startswith("routed by r1 to w1: 16/18 prompt tokens cached")
        assert lines[1].startswith("  w1: 16/18 prompt tokens cached, load 0+0/8")
        (rec,) = await trace_records(js, names, cold.request_id)
        assert rec.outcome == "directed" and rec.route.chosen == home in ("w1", "w2")
        assert rec.route.why.startswith("prompt's home: no cached prefix anywhere")


async def test_a_router_starts_warm_from_the_stream_and_resyncs_an_instance_after_a_gap(nats_url, namespace):
    async with Client(nats_url, namespace=namespace) as c:
        names, js, nc = c.names, c.js, c.nc
        await register(js, names, "w1", "w2")
        await ensure_kv_events_stream(js, names, QueuePolicy())
        for seq in range(1, 41):  # history to replay: the last batch stores A again
            await kv_batch(js, names, "w1", seq, [KvCleared()] if seq < 40 else [stored(A)])
        asked: list[str] = []

        async def resync(msg) -> None:
            asked.append(msg.subject)

        await nc.subscribe(names.instance_control("w1", "kv-resync"), cb=resync)
        router = Router(MODEL)
        async with router.running(nc, names):
            # warm from its first look: the replay is applied before start returns
            assert router.overlaps(A) == {"w1": 16}
            await kv_batch(js, names, "w1", 42, [stored(COLD)])  # seq 41 is missing
            await eventually(lambda: asked)
            assert router.overlaps(A) == {}  # unknown until the snapshot: nothing predicted
            assert router.overlaps(COLD) == {"w1": 16} and router.feed.counters["gaps"] == 1
            snapshot = KvResync(reason="requested", part=1, parts=1, blocks=4)
            await kv_batch(js, names, "w1", 43, [KvCleared(), stored(A)], snapshot)
            await eventually(lambda: router.overlaps(A) == {"w1": 16})
            assert router.overlaps(COLD) == {}
            # an instance that leaves the registry takes its blocks with it
            kv = await ensure_registry(js, names)
            await kv.delete(names.instance_key("w1"))
            await eventually(lambda: router.overlaps(A) == {})
            assert router.index.blocks == 0


def load_report(inst: str, running: int = 1) -> bytes:
    report = LoadReport(
        instance=inst, model=MODEL, at=time.time(), running=running, waiting=0, in_flight=0, slots=8
    )
    return codec.encode(report)


async def test_a_router_keeps_nothing_of_instances_the_registry_does_not_show(nats_url, namespace):
    """KV events and load reports naming instances the registry does not show leave no state
    behind; a real instance's count; a worker whose first events beat its registry record (its
    relay starts before it registers) has them applied once it registers, without a snapshot asked."""
    async with Client(nats_url, namespace=namespace) as c:
        names, js, nc = c.names, c.js, c.nc
        await register(js, names, "w1")
        await ensure_kv_events_stream(js, names, QueuePolicy())
        asked: list[str] = []

        async def resync(msg) -> None:
            asked.append(msg.subject)

        for inst in ("w1", "w3"):
            await nc.subscribe(names.instance_control(inst, "kv-resync"), cb=resync)
        router = Router(MODEL)
        async with router.running(nc, names):
            for i in range(200):
                await kv_batch(js, names, f"forged-{i}", 1, [stored(A)])
                await nc.publish(names.load(MODEL, f"forged-{i}"), load_report(f"forged-{i}"))
            await kv_batch(js, names, "w1", 1, [stored(A)])
            await nc.publish(names.load(MODEL, "w1"), load_report("w1", running=3))
            await eventually(lambda: router.overlaps(A) == {"w1": 16} and bool(router.loads.of("w1")))
            assert router.index.instances() == {"w1"} and set(router.feed.last) == {"w1"}
            assert set(router.loads.reports) == {"w1"}
            assert router.loads.counters["dropped_unregistered"] == 200
            assert router.feed.counters["held_unregistered"] == 200
            assert [c.running for c in router.candidates()] == [3]

            start = KvResync(reason="start", part=1, parts=1)
            await kv_batch(js, names, "w3", 1, [KvCleared(), stored(COLD)], start)
            await eventually(lambda: router.feed.counters["held_unregistered"] == 201)
            assert router.overlaps(COLD) == {}
            await register(js, names, "w3")
            await eventually(lambda: router.overlaps(COLD) == {"w3": 16})
            assert router.feed.counters["applied_late"] == 1 and router.index.instances() == {"w1", "w3"}
            exported = {m.name: m.samples[0].value for m in RouterCollector(router).collect() if m.samples}
            assert exported["jetllm_router_kv_held_unregistered"] == 201
            assert exported["jetllm_router_load_dropped_unregistered"] == 200
        assert asked == []


async def test_several_routers_place_every_job_of_the_routing_queue_exactly_once(nats_url, namespace):
    async with Client(nats_url, namespace=namespace, via_routers=True) as c:
        names, js, nc = c.names, c.js, c.nc
        await register(js, names, "w1", "w2")
        await ensure_kv_events_stream(js, names, QueuePolicy())
        await kv_batch(js, names, "w1", 1, [stored(A)])
        jobs = [req(MODEL, A if i % 2 else COLD) for i in range(30)]

        # a router that died after publishing its placed copy, before acking the job
        durable = await bind(nc, names, "generate", MODEL, c._policy, ack_wait=1.0)
        first = jobs[0]
        await c.submit(first)
        pull = await js.pull_subscribe_bind(durable, stream=names.routing_stream)
        (msg,) = await pull.fetch(1, timeout=5)
        await publish_directed(
            js,
            names,
            role="generate",
            model=MODEL,
            instance=None,
            data=msg.data,
            headers={**msg.headers, "Nats-Msg-Id": first.request_id},
        )
        await pull.unsubscribe()

        for job in jobs[1:]:
            await c.submit(job)
        routers = [Router(MODEL, name=f"r{i}") for i in range(2)]
        try:
            async with anyio.create_task_group() as tg:
                for r in routers:
                    await r.start(nc, names)
                    tg.start_soon(lambda r=r: serve(nc, names, r, batch=4, ack_wait=1.0))
                await eventually(lambda: sum(r.stats.decisions for r in routers) >= len(jobs), timeout=20)

                async def drained() -> bool:
                    info = await js.consumer_info(names.routing_stream, durable)
                    return info.num_pending == 0 and info.num_ack_pending == 0

                with anyio.fail_after(10):
                    while not await drained():
                        await anyio.sleep(0.1)
                placed = await stored_jobs(js, names)
                tg.cancel_scope.cancel()
        finally:
            for r in routers:
                await r.close()

    ids = [rid for _, rid in placed]
    assert sorted(ids) == sorted(j.request_id for j in jobs)  # each job once, none lost
    directed = names.directed_jobs("generate", MODEL, "w1")
    by_id = dict((rid, subject) for subject, rid in placed)
    assert all(by_id[job.request_id] == directed for job in jobs[1::2])
    homes = {by_id[job.request_id] for job in jobs[2::2]}  # the cold prompt: one home, whichever router
    assert len(homes) == 1 and homes <= {names.directed_jobs("generate", MODEL, w) for w in ("w1", "w2")}


async def test_a_job_the_router_cannot_place_goes_to_the_shared_queue_once(nats_url, namespace):
    """A LoRA job with a token id past 32 bits (valid by the schema) once made the router raise: left
    unacked, it came back every ack_wait and never reached a worker. Any failure to place now sends
    the job to the shared queue, where a worker answers it."""
    async with Client(nats_url, namespace=namespace, via_routers=True) as c:
        names, js, nc = c.names, c.js, c.nc
        await register(js, names, "w1")
        await ensure_kv_events_stream(js, names, QueuePolicy())
        wide = req(MODEL, [1, 2, 3, 4, 5, 2**32, 7, 8, 9], adapter="ad")
        broken = req(MODEL, COLD)
        router = Router(MODEL, name="r1")
        real_decide = router.decide

        def decide(request, tokens):
            if request.request_id == broken.request_id:
                raise RuntimeError("a bug in deciding")
            return real_decide(request, tokens)

        router.decide = decide  # type: ignore[method-assign]
        await c.submit(wide)
        await c.submit(broken)
        try:
            async with anyio.create_task_group() as tg:
                await router.start(nc, names)
                tg.start_soon(lambda: serve(nc, names, router, batch=4, ack_wait=1.0))
                with anyio.fail_after(10):
                    while (await js.stream_info(names.jobs_stream)).state.messages < 2:
                        await anyio.sleep(0.1)
                tg.cancel_scope.cancel()
        finally:
            await router.close()
        placed = dict((rid, subject) for subject, rid in await stored_jobs(js, names))
    assert placed[broken.request_id] == names.jobs("generate", MODEL)
    assert wide.request_id in placed
