"""The fleet control plane against a real nats-server, with the light test engine (fast): the
registry, the control verbs and their fan-out, health with its canary, sleep and wake.

The same behaviours against real vLLM: test_vllm_fleet.py.
"""

from __future__ import annotations

from contextlib import aclosing

import anyio
import msgspec
import pytest

from jetllm.producer import Client
from jetllm.producer.fleet import ask
from jetllm.producer.registry import instances, model_cards
from jetllm.producer.traces import trace_records
from jetllm.schemas import (
    ControlDone,
    ControlFailed,
    ErrorCode,
    HealthCheck,
    HealthReport,
    LoadReport,
    PulledFrame,
    SleepRequest,
    TasksReport,
    TokensFrame,
)
from jetllm.subjects import codec

from .conftest import inproc_worker
from .fake_engine import FakeEngine
from .jobs import consumer_counts, req

pytestmark = pytest.mark.anyio


async def _wait_for(predicate, timeout: float = 10.0):
    with anyio.fail_after(timeout):
        while not (found := await predicate()):
            await anyio.sleep(0.05)
    return found


async def test_registry_lists_a_worker_with_its_facts_and_drops_it_on_stop(nats_url, client, fake_engine):
    js, names = client.nc.jetstream(), client.names
    async with inproc_worker(
        nats_url, fake_engine, namespace=names.namespace, registry_interval=0.2
    ) as worker:
        (record,) = await _wait_for(lambda: instances(js, names))
        assert record.instance == worker.instance and record.model == "fake" and record.role == "generate"
        assert record.state == "serving" and record.ready
        assert record.engine.block_size == 16 and record.engine.num_kv_blocks == 1024
        assert record.engine.max_model_len == 256 and record.slots == worker.slots.total
        assert record.expires_after == pytest.approx(0.6)
        (card,) = await model_cards(js, names)
        assert card.model == "fake" and card.max_model_len == 256
        sub = await client.nc.subscribe(names.load("fake", worker.instance))
        report = codec.Decoder(LoadReport).decode((await sub.next_msg(timeout=3)).data)
        await sub.unsubscribe()
        assert report.instance == worker.instance and report.dp_rank == 0
        assert report.slots == worker.slots.total
        assert report.state == "serving" and report.num_kv_blocks == 1024
    assert await instances(js, names) == []  # a clean stop removes the record at once


async def test_a_record_whose_heartbeats_stopped_does_not_count(nats_url, client, fake_engine):
    js, names = client.nc.jetstream(), client.names
    async with inproc_worker(
        nats_url, fake_engine, namespace=names.namespace, registry_interval=0.2
    ) as worker:
        await _wait_for(lambda: instances(js, names))

        def hung():
            raise RuntimeError("hung")

        worker.registry._record = hung  # no more heartbeats; the last record stays in the bucket
        with anyio.fail_after(5):
            while await instances(js, names):
                await anyio.sleep(0.1)


async def test_health_canary_passes_then_fails_on_a_stall_and_on_a_dead_engine(nats_url, client, fake_engine):
    names = client.names
    async with inproc_worker(nats_url, fake_engine, namespace=names.namespace) as worker:
        (ok,) = await ask(client.nc, names, "health", instance=worker.instance)
        assert isinstance(ok, HealthReport) and ok.healthy and ok.canary_ok and ok.canary_tokens == 4
        assert ok.engine_alive and ok.state == "serving" and ok.last_error is None

        fake_engine.stalled = True
        body = codec.encode(HealthCheck(stall_timeout=0.3))
        (stalled,) = await ask(client.nc, names, "health", body, instance=worker.instance)
        assert not stalled.healthy and stalled.engine_alive and stalled.canary_ok is False
        assert "stalled" in stalled.last_error
        fake_engine.stalled = False

        fake_engine.dead = True
        (dead,) = await ask(client.nc, names, "health", instance=worker.instance)
        assert not dead.healthy and not dead.engine_alive and dead.canary_ok is None
        fake_engine.dead = False


async def test_health_refuses_a_canary_it_cannot_run_naming_the_field(nats_url, client, fake_engine):
    """A NaN or non-positive stall timeout would fail the canary at once (and leave `last_error`
    saying so): it is an invalid request instead, and the next check is healthy."""
    names = client.names
    cases = [
        ({"stall_timeout": float("nan")}, "$.stall_timeout"),
        ({"stall_timeout": 0.0}, "$.stall_timeout"),
        ({"stall_timeout": -1.0}, "$.stall_timeout"),
        ({"stall_timeout": float("inf")}, "$.stall_timeout"),
        ({"max_tokens": 0}, "$.max_tokens"),
        ({"max_tokens": 10**9}, "$.max_tokens"),
    ]
    async with inproc_worker(nats_url, fake_engine, namespace=names.namespace) as worker:
        for body, field in cases:
            (bad,) = await ask(
                client.nc, names, "health", msgspec.msgpack.encode(body), instance=worker.instance
            )
            assert isinstance(bad, ControlFailed) and bad.code == ErrorCode.INVALID_REQUEST, (body, bad)
            assert f"`{field}`" in bad.message, (body, bad)
        (ok,) = await ask(client.nc, names, "health", instance=worker.instance)
        assert ok.healthy and ok.canary_ok and ok.last_error is None


async def test_control_requests_are_strict_like_jobs(nats_url, client, fake_engine):
    """Another schema version is refused as a job would be, a verb without a request refuses any
    field, and a missing required field is named; what jetllm's own callers send still works."""
    names = client.names
    refused = [
        ("sleep", {"v": 99, "level": 1}, ErrorCode.UNSUPPORTED_VERSION, "$.v: schema version 99"),
        (
            "sleep",
            {"v": 2, "level": 1, "deeper": True},
            ErrorCode.UNSUPPORTED_VERSION,
            "$.v: schema version 2",
        ),
        ("tasks", {"v": 7}, ErrorCode.UNSUPPORTED_VERSION, "$.v: schema version 7"),
        ("wake", {"force": True}, ErrorCode.INVALID_REQUEST, "wake: $.force: Object contains unknown field"),
        ("reset-prefix-cache", [1], ErrorCode.INVALID_REQUEST, "Expected `object`"),
        ("lora-load", b"", ErrorCode.INVALID_REQUEST, "lora-load: $.name: Object missing required field"),
        (
            "lora-load",
            {"version": 1},
            ErrorCode.INVALID_REQUEST,
            "lora-load: $.name: Object missing required",
        ),
    ]
    accepted = [
        ("wake", b""),
        ("wake", {}),
        ("wake", {"v": 1}),
        ("reset-prefix-cache", b""),
        ("tasks", {"v": 1}),
    ]
    async with inproc_worker(nats_url, fake_engine, namespace=names.namespace) as worker:
        for verb, body, code, message in refused:
            raw = body if isinstance(body, bytes) else msgspec.msgpack.encode(body)
            (reply,) = await ask(client.nc, names, verb, raw, instance=worker.instance)
            assert isinstance(reply, ControlFailed) and reply.code == code, (verb, body, reply)
            assert message in reply.message, (verb, body, reply)
        assert worker.state == "serving"  # the sleep of another version did not run
        for verb, body in accepted:
            raw = body if isinstance(body, bytes) else msgspec.msgpack.encode(body)
            (reply,) = await ask(client.nc, names, verb, raw, instance=worker.instance)
            assert not isinstance(reply, ControlFailed), (verb, body, reply)


async def test_tasks_names_each_running_request_and_where_it_waits(nats_url, client):
    """The operator's view of a worker over NATS, as SIGUSR1 writes it to its log."""
    engine = FakeEngine(step_delay=0.02, max_model_len=100_000)
    names = client.names
    async with inproc_worker(nats_url, engine, namespace=names.namespace) as worker:
        long = req("fake", max_tokens=50_000)
        async with aclosing(client.generate(long)) as frames:
            async for frame in frames:
                if isinstance(frame, TokensFrame):
                    break
            (report,) = await ask(client.nc, names, "tasks", instance=worker.instance)
    assert isinstance(report, TasksReport) and report.instance == worker.instance
    jobs = [t for t in report.tasks if t.name.startswith(f"job {long.request_id}")]
    assert jobs, [t.name for t in report.tasks]
    assert any("fake_engine.py" in step for t in jobs for step in t.awaits), jobs


async def test_model_wide_verbs_get_one_reply_per_instance(nats_url, client):
    names = client.names
    async with (
        inproc_worker(nats_url, FakeEngine(), namespace=names.namespace, registry_interval=0.2) as a,
        inproc_worker(nats_url, FakeEngine(), namespace=names.namespace, registry_interval=0.2) as b,
    ):
        await _wait_for(lambda: _count(client, 2))
        replies = await ask(client.nc, names, "reset-prefix-cache", model="fake", timeout=5)
        assert sorted(r.instance for r in replies) == sorted([a.instance, b.instance])
        assert all(isinstance(r, ControlDone) and r.detail == "prefix cache cleared" for r in replies)
        (bad,) = await ask(
            client.nc, names, "sleep", codec.encode(SleepRequest(level=7)), instance=a.instance
        )
        assert (
            isinstance(bad, ControlFailed)
            and bad.code == ErrorCode.INVALID_REQUEST
            and "level" in bad.message
        )
        (garbage,) = await ask(client.nc, names, "sleep", b"\xc1not msgpack", instance=a.instance)
        assert isinstance(garbage, ControlFailed) and garbage.code == ErrorCode.INVALID_REQUEST
        with pytest.raises(LookupError):
            await ask(client.nc, names, "health", instance="no-such-instance", timeout=2)


async def _count(client, n: int):
    return len(await instances(client.nc.jetstream(), client.names)) == n


async def test_a_sleeping_worker_pulls_nothing_until_woken(nats_url, client, fake_engine):
    js, names = client.nc.jetstream(), client.names
    async with inproc_worker(
        nats_url, fake_engine, namespace=names.namespace, registry_interval=0.2
    ) as worker:
        with anyio.fail_after(5):
            while not worker.pulls.outstanding:  # it holds pull credit, as any idle worker does
                await anyio.sleep(0.01)
        (done,) = await ask(client.nc, names, "sleep", instance=worker.instance)
        assert isinstance(done, ControlDone) and done.state == "sleeping" and "paused" in done.detail
        (record,) = await _wait_for(lambda: _sleeping(js, names))
        assert not record.ready
        (report,) = await ask(client.nc, names, "health", instance=worker.instance)
        assert report.healthy and report.state == "sleeping" and report.canary_ok is None

        async with anyio.create_task_group() as tg:
            result = {}

            async def run() -> None:
                result["c"] = await client.complete(req("fake", max_tokens=3))

            tg.start_soon(run)
            with anyio.fail_after(5):
                while await consumer_counts(client.nc, names, "fake") == (0, 0):
                    await anyio.sleep(0.01)
            for _ in range(10):  # within the credit's expiry: the pause cancelled it, nothing is delivered
                assert await consumer_counts(client.nc, names, "fake") == (1, 0)  # left in JetStream
                await anyio.sleep(0.1)
            assert "c" not in result and worker.counters.pulled == 0
            (woke,) = await ask(client.nc, names, "wake", instance=worker.instance)
            assert isinstance(woke, ControlDone) and woke.state == "serving"
            with anyio.fail_after(5):  # not after an ack_wait: the job was never held by the sleeper
                while "c" not in result:
                    await anyio.sleep(0.01)
        assert len(result["c"].token_ids) == 3
        (record,) = await instances(js, names)
        assert record.state == "serving" and record.ready


async def _sleeping(js, names):
    return [r for r in await instances(js, names) if r.state == "sleeping"]


async def test_a_malformed_trace_record_is_skipped_and_the_others_still_read(
    nats_url, namespace, fake_engine
):
    async with (
        Client(nats_url, namespace=namespace) as client,
        inproc_worker(nats_url, fake_engine, namespace=namespace),
    ):
        names, js = client.names, client.nc.jetstream()
        first, second = req("fake", max_tokens=2), req("fake", max_tokens=2)
        await client.complete(first)
        with anyio.fail_after(5):
            while not await trace_records(js, names, first.request_id):
                await anyio.sleep(0.1)
        for junk in (b"\xc1", msgspec.msgpack.encode({"request_id": 7}), b"\x91" * 100_000):
            await js.publish(names.trace(first.request_id), junk)
        await client.complete(second)
        with anyio.fail_after(5):
            while second.request_id not in {r.request_id for r in await trace_records(js, names)}:
                await anyio.sleep(0.1)
        records = await trace_records(js, names)
    assert sorted(r.request_id for r in records) == sorted([first.request_id, second.request_id])


async def test_a_trace_id_travels_on_the_job_its_first_and_last_frame_and_the_worker_timing_record(
    nats_url, namespace, fake_engine
):
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    # JSON frames are sent one message each (msgpack ones may go batched, without headers)
    async with (
        Client(nats_url, namespace=namespace, encoding="json") as client,
        inproc_worker(nats_url, fake_engine, namespace=namespace) as worker,
    ):
        names = client.names
        sub = await client.nc.subscribe(f"{client._inboxes.root}.>")  # a second listener on the frames
        request = req("fake", max_tokens=5)
        frames = [f async for f in client.generate(request, traceparent=f"00-{trace_id}-{parent}-01")]
        assert len(frames) >= 3
        seen = []
        with anyio.move_on_after(1):
            while True:
                seen.append(await sub.next_msg(timeout=5))  # the scope ends the loop, not a timeout
        await sub.unsubscribe()
        traced = [m for m in seen if m.headers]  # token frames go without: one header parse per token
        kinds = [type(codec.frame_decoder.decode(m.data, "json")).__name__ for m in traced]
        assert kinds == ["AcceptedFrame", "FinalFrame"]
        headers = {m.headers.get("traceparent") for m in traced}
        pulled = [m for m in seen if isinstance(codec.frame_decoder.decode(m.data, "json"), PulledFrame)]
        assert len(pulled) == 1  # the client's to act on, not passed to the caller
        assert len(seen) == len(frames) + 1 and len(headers) == 1
        (header,) = headers
        assert header.startswith(f"00-{trace_id}-") and not header.startswith(f"00-{trace_id}-{parent}")

        with anyio.fail_after(5):
            while not (records := await trace_records(client.nc.jetstream(), names, request.request_id)):
                await anyio.sleep(0.1)
        (rec,) = records
        assert (
            rec.trace_id == trace_id
            and rec.parent_span_id == parent
            and header == f"00-{trace_id}-{rec.span_id}-01"
        )
        assert rec.instance == worker.instance and rec.outcome == "completed" and rec.completion_tokens == 5
        assert (
            rec.queued_at
            <= rec.pulled_at
            <= rec.started_at
            <= rec.accepted_at
            <= rec.first_token_at
            <= rec.ended_at
        )

        # a malformed header from a producer starts a fresh trace instead of failing the job
        bad = req("fake", max_tokens=2)
        job = await client.nc.jetstream().publish(
            names.jobs("generate", "fake"),
            codec.encode(bad),
            headers={"Nats-Msg-Id": bad.request_id, "traceparent": "00-zz-not-a-trace-01"},
        )
        assert job.seq
        with anyio.fail_after(10):
            while not (records := await trace_records(client.nc.jetstream(), names, bad.request_id)):
                await anyio.sleep(0.1)
        assert records[0].parent_span_id is None and len(records[0].trace_id) == 32


async def test_registry_readers_skip_entries_no_worker_wrote(nats_url, client, fake_engine):
    """Anyone can write the registry bucket: garbage under i.* and m.* is skipped by every reader
    (fleet commands, LoRA fan-outs), which still see the live worker and its model card."""
    from jetllm.producer.registry import watch

    async with inproc_worker(nats_url, fake_engine, namespace=client.names.namespace) as w:
        bucket = client.names.registry_bucket
        for key, value in [
            ("i._FF", b"\xa1\xff"),
            ("i.x", b"\xc1"),
            ("i.deep", b"\x91" * 100_000 + b"\x00"),
            ("i.json", b'{"instance": "x"}'),
            ("m.x", b"garbage"),
            ("m._C3_28", b"\xa2\xc3\x28"),
        ]:
            await client.js.publish(f"$KV.{bucket}.{key}", value)
        assert [r.instance for r in await instances(client.js, client.names)] == [w.instance]
        assert [c.model for c in await model_cards(client.js, client.names)] == ["fake"]
        with anyio.fail_after(10):
            async for live in watch(client.js, client.names):
                if any(r.instance == w.instance for r in live.values()):
                    assert len(live) == 1, live
                    break
