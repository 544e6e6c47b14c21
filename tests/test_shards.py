"""Shards: a batch's lines travel many to a job (schemas/shard.py, workers/shards.py), on the light
test engine against a real nats-server. Every line still gets its own claim and result in its own
log, no worker takes more lines than it has slots, a line that ended is never run again, and a
shard that cannot run fails each of its lines by name without stopping the worker."""

from __future__ import annotations

import json
from collections import Counter
from contextlib import asynccontextmanager

import anyio
import msgspec
import nats.errors
import pytest

from jetllm.batches import plan
from jetllm.batches.lines import line_request_id
from jetllm.batches.runner import BatchRunner
from jetllm.cli import main
from jetllm.openai.endpoints import CHAT
from jetllm.producer import Client
from jetllm.producer import deadletters as dead_letters
from jetllm.schemas import (
    CancelRequest,
    ChatMessage,
    ChatPrompt,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    GenerateRequest,
    Result,
    ShardJob,
    StopConditions,
    TokensPrompt,
)
from jetllm.subjects import codec
from jetllm.subjects.names import SHARD_QUEUE
from jetllm.subjects.policy import QueuePolicy
from jetllm.workers.pullshare import shard_allowance, shard_kept
from jetllm.workers.shards import shard_room

from .conftest import inproc_worker
from .fake_engine import FakeEngine
from .test_batches import ACK_WAIT, _instance, api, chat_line, jsonl, peak_engine, wait_status

__all__ = ["api"]  # the fixture

pytestmark = pytest.mark.anyio


# pure rules


@pytest.mark.parametrize("slots, room", [(1, 0), (7, 0), (8, 2), (32, 8), (256, 64), (1024, 64)])
def test_a_worker_wants_shards_of_a_quarter_of_its_slots_at_most_64(slots, room):
    assert shard_room(slots) == room


@pytest.mark.parametrize(
    "free, beyond, paused, directed_short, ask, keep",
    [
        (5, 0, False, False, 1, 1),  # a free slot: it asks for one shard
        (0, 0, False, False, 0, 1),  # full: it keeps its pull (no renewal per online job), asks no more
        (0, 1, False, False, 0, 0),  # a shard's requests wait beyond the slots: no second shard
        (0, 40, False, False, 0, 0),
        (5, 0, True, False, 0, 0),  # paused (a sleep on its way)
        (5, 0, False, True, 0, 0),  # directed jobs wait for every free slot
    ],
)
def test_the_shard_puller_asks_for_one_shard_while_a_slot_is_free_and_keeps_it_through_a_full_worker(
    free, beyond, paused, directed_short, ask, keep
):
    assert shard_allowance(free, beyond, paused, directed_short) == ask
    assert shard_kept(beyond, paused, directed_short) == keep


def _record(model="m", shard_lines=16, state="serving", ready=True, role="generate"):
    return _instance(model, state, ready=ready, role=role, shard_lines=shard_lines)


@pytest.mark.parametrize(
    "records, most, sizes",
    [
        ([_record()], 64, {"m": 16}),
        ([_record(), _record(shard_lines=4)], 64, {"m": 4}),  # no worker gets more than it asked for
        ([_record(shard_lines=64)], 10, {"m": 10}),  # nor more than the runner's --batch-shard-lines
        ([_record(), _record(shard_lines=0)], 64, {}),  # a worker that takes none: lines go singly
        ([_record(shard_lines=64)], 1, {}),  # --batch-shard-lines 1: singly
        ([_record(state="draining"), _record(model="n", ready=False)], 64, {}),  # not serving
        ([_record(role="prefill")], 64, {}),
    ],
)
def test_a_model_gets_shards_no_larger_than_its_smallest_taker_asks(records, most, sizes):
    assert plan.shard_sizes(records, most) == sizes


@pytest.mark.parametrize(
    "sizes, most, limit, parts",
    [
        ([1] * 5, 2, 100, [2, 2, 1]),
        ([40, 40, 40], 10, 100, [2, 1]),  # bytes bound a shard too
        ([150, 1, 1], 10, 100, [1, 2]),  # a line larger than the bound travels alone
        ([], 4, 100, []),
    ],
)
def test_lines_are_cut_into_shards_by_count_and_bytes(sizes, most, limit, parts):
    assert [len(p) for p in plan.shards(sizes, most, limit, lambda n: n)] == parts


# on the plane


def _request(rid: str, **kw) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model="fake",
        prompt=TokensPrompt(token_ids=[1, 2, 3]),
        stop=StopConditions(max_tokens=5, ignore_eos=True),
        **kw,
    )


def finishing_engine(**kw) -> FakeEngine:
    """A fake engine that counts, per request, the generations it ran to their end (`finished`):
    an early start stopped before anything was sent is not a run."""
    engine = FakeEngine(**kw)
    engine.finished = Counter()  # type: ignore[attr-defined]
    generate = engine.generate

    async def counted(req, *args, **kwargs):
        async for out in generate(req, *args, **kwargs):
            yield out
        engine.finished[req.request_id] += 1  # type: ignore[attr-defined]

    engine.generate = counted  # type: ignore[method-assign]
    return engine


async def _results(client: Client, ids: list[str], timeout: float = 30) -> dict[str, Result]:
    found: dict[str, Result] = {}
    with anyio.fail_after(timeout):
        while len(found) < len(ids):
            for rid in ids:
                if rid not in found and (r := await client.result(rid)) is not None:
                    found[rid] = r
            await anyio.sleep(0.05)
    return found


async def test_a_batch_travels_in_shards_within_each_workers_slots_and_every_line_has_its_result(
    api, nats_url, namespace, capsys
):
    sdk, client, service = api
    n = 100
    f = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in range(n)])), purpose="batch")
    batch = await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    engine = peak_engine(step_delay=0.02)
    async with (
        inproc_worker(nats_url, engine, namespace=namespace, slots=32),
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(BatchRunner(client, service, ack_wait=ACK_WAIT).serve)
        done = await wait_status(sdk, batch.id, {"completed", "failed"})
        shards = await client.js.consumer_info(
            client.names.jobs_stream, client.names.consumer(SHARD_QUEUE, "fake")
        )
        singles = await client.js.consumer_info(
            client.names.jobs_stream, client.names.consumer("generate", "fake")
        )
        tg.cancel_scope.cancel()
    assert done.status == "completed" and done.request_counts.completed == n
    out = [json.loads(x) for x in (await sdk.files.content(done.output_file_id)).content.splitlines()]
    assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(n)]
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == 6 for x in out)
    # the lines went as shards of at most the worker's room (8 of its 32 slots), none singly
    assert singles.delivered.stream_seq == 0
    taken = shards.delivered.consumer_seq
    assert n / shard_room(32) <= taken <= n / 2, f"{taken} shards for {n} lines"
    assert engine.peak <= 32 + shard_room(32), engine.peak  # its slots, and the rest of one shard
    for i in (1, n):  # each line's own log holds its result, as a line sent alone has
        stored = await client.result(line_request_id(batch.id, i))
        assert stored is not None and stored.final is not None
    # a line keeps no trace record of its own: `jetllm trace` says so, and what its result says
    first = line_request_id(batch.id, 1)
    stored = await client.result(first)
    argv = ["trace", "--nats", nats_url, "--namespace", namespace, first]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    said = capsys.readouterr().err
    assert "travelled in a shard" in said and f"completed by worker {stored.worker}" in said, said
    assert ": 6 tokens" in said, said
    assert await anyio.to_thread.run_sync(main, [*argv, "--json"]) == 1  # no trace records to print
    assert capsys.readouterr().out == ""


FULL = 8
"""The slots of the worker that online jobs fill in the tests below."""


@asynccontextmanager
async def _full_worker(nats_url: str, namespace: str, pull_expires: float):
    """A worker of FULL slots that online jobs of three seconds (60 steps of 50 ms) fill: yields
    the client, the worker, its engine and those jobs."""
    engine = peak_engine(step_delay=0.05)
    online = [
        msgspec.structs.replace(_request(f"online-{i}"), stop=StopConditions(max_tokens=60, ignore_eos=True))
        for i in range(FULL)
    ]
    async with (
        Client(nats_url, namespace=namespace) as client,
        inproc_worker(nats_url, engine, namespace=namespace, slots=FULL, pull_expires=pull_expires) as worker,
    ):
        for r in online:
            await client.submit(r)
        with anyio.fail_after(10):
            while worker.slots.busy < FULL:
                await anyio.sleep(0.02)
        yield client, worker, engine, online


async def _shard_beside(client: Client, name: str, online: list[GenerateRequest]) -> dict[str, Result]:
    """Submits a shard of `shard_room(FULL)` requests; the results of those and of `online`."""
    ids = [f"{name}-{i}" for i in range(shard_room(FULL))]
    await client.submit_shard(ShardJob(request_id=name, model="fake", requests=[_request(r) for r in ids]))
    return await _results(client, ids + [r.request_id for r in online])


async def _shard_pulls(client: Client) -> int:
    info = await client.js.consumer_info(client.names.jobs_stream, client.names.consumer(SHARD_QUEUE, "fake"))
    return info.num_waiting


async def test_a_full_worker_keeps_its_shard_pull_and_takes_a_shard_into_its_engines_queue(
    nats_url, namespace
):
    """A worker whose slots online jobs fill keeps the pull of the shard queue it made while a slot
    was free (dropping and renewing it would cost a new inbox and a round trip per job), and a
    shard that comes runs beside them, its requests beyond the slots waiting in the engine's queue."""
    async with _full_worker(nats_url, namespace, pull_expires=30) as (client, worker, engine, online):
        worker.pulls.wake()  # every puller looks at its credit again
        await anyio.sleep(0.3)
        assert await _shard_pulls(client) == 1, "a full worker dropped its shard pull"
        results = await _shard_beside(client, "beside", online)
    assert all(r.final is not None for r in results.values())
    assert engine.peak == FULL + shard_room(FULL)  # the shard ran while every slot was busy


async def test_a_full_worker_lets_its_shard_pull_run_out_and_asks_again_once_a_slot_is_free(
    nats_url, namespace
):
    """So that shards go first to workers with room: a full worker does not renew its pull, and
    a shard queued meanwhile waits for its first free slot."""
    async with _full_worker(nats_url, namespace, pull_expires=1.0) as (client, worker, engine, online):
        with anyio.fail_after(2.5):  # before the online jobs end
            while await _shard_pulls(client):
                await anyio.sleep(0.05)
        assert worker.slots.busy == FULL
        results = await _shard_beside(client, "after", online)
    assert all(r.final is not None for r in results.values())
    assert engine.peak < FULL + shard_room(FULL)  # it came once online jobs had ended


@pytest.mark.parametrize("fresh", [True, False])
async def test_a_shard_runs_only_its_requests_without_a_result(nats_url, namespace, fresh):
    """Whether its submitter calls it fresh or not, a request that ended (its result in its log:
    a resubmitted or redelivered shard) is never run again, and the others run once. Only a shard
    not called fresh reads each request's durable cancel (a fresh one is cancelled as a whole)."""
    async with Client(nats_url, namespace=namespace) as client:
        ids = [f"sh-{fresh}-{i}" for i in range(10)]
        done_before = ids[:3]
        for rid in done_before:
            await client.js.publish(client.names.request_log(rid), codec.encode(_stored(rid)))
        await client.cancel(ids[3], reason="not wanted")
        engine = finishing_engine()
        async with inproc_worker(nats_url, engine, namespace=namespace, slots=32):
            shard = ShardJob(
                request_id=f"shard-{fresh}", model="fake", requests=[_request(r) for r in ids], fresh=fresh
            )
            await client.submit_shard(shard)
            results = await _results(client, ids)
    ran = ids[3:] if fresh else ids[4:]
    assert set(engine.finished) == set(ran) and max(engine.finished.values()) == 1
    for rid in ran:
        assert results[rid].final is not None and results[rid].final.choices[0].completion_tokens == 5
    if not fresh:
        assert results[ids[3]].error is not None and results[ids[3]].error.code == ErrorCode.CANCELLED
    for rid in done_before:
        assert results[rid].worker == "earlier"  # left as it was


def _stored(rid: str) -> Result:
    from jetllm.schemas import Choice, Usage

    final = FinalFrame(
        seq=2,
        request_id=rid,
        choices=[Choice(index=0, finish_reason="length", completion_tokens=1)],
        usage=Usage(prompt_tokens=3, completion_tokens=1),
    )
    return Result(attempt=1, final=final, token_ids=[[7]], worker="earlier")


@pytest.mark.parametrize("cancelled", ["the-shard", "its-batch"])
async def test_a_fresh_shard_cancelled_as_a_whole_lets_each_request_read_its_own_cancel(
    nats_url, namespace, cancelled
):
    """Cancelled by its own id, or by its group's (a batch stopped by another runner than the one
    that queued the shard)."""
    async with Client(nats_url, namespace=namespace) as client:
        ids = [f"whole-{cancelled}-{i}" for i in range(6)]
        await client.cancel(cancelled, reason="batch stopped")
        await client.cancel(ids[0], reason="batch stopped")
        engine = finishing_engine()
        async with inproc_worker(nats_url, engine, namespace=namespace, slots=32):
            shard = ShardJob(
                request_id="the-shard",
                model="fake",
                requests=[_request(r) for r in ids],
                fresh=True,
                group="its-batch",
            )
            await client.submit_shard(shard)
            results = await _results(client, ids)
    assert results[ids[0]].error is not None and results[ids[0]].error.code == ErrorCode.CANCELLED
    assert set(engine.finished) == set(ids[1:])


async def test_a_request_that_cannot_be_a_line_fails_alone_and_the_others_run(nats_url, namespace):
    async with Client(nats_url, namespace=namespace) as client:
        good = [f"ok-{i}" for i in range(4)]
        requests = [_request(r) for r in good]
        requests.insert(1, _request("elsewhere", reply_to="_INBOX.someone.1"))
        requests.insert(3, msgspec.structs.replace(_request("other-model"), model="not-fake"))
        requests.append(_request(good[0]))  # named twice: runs once
        engine = finishing_engine()
        async with inproc_worker(nats_url, engine, namespace=namespace, slots=32):
            await client.submit_shard(
                ShardJob(request_id="mixed", model="fake", requests=requests, fresh=True)
            )
            results = await _results(client, [*good, "elsewhere", "other-model"])
    assert set(engine.finished) == set(good) and max(engine.finished.values()) == 1
    bad = {rid: results[rid].error for rid in ("elsewhere", "other-model")}
    assert all(e is not None and e.code == ErrorCode.INVALID_REQUEST for e in bad.values())
    assert bad["elsewhere"].field == "$.requests[1].reply_to"  # type: ignore[union-attr]
    assert bad["other-model"].field == "$.requests[3].model"  # type: ignore[union-attr]
    async with Client(nats_url, namespace=namespace) as client:
        letters = await dead_letters.entries(client.nc, client.names)
    (letter,) = [e.record for e in letters if e.record.request_id == "other-model"]
    # a line's dead letter is the line as a job of its own, so `jetllm dlq replay` runs it as one
    assert letter.subject == client.names.jobs("generate", "fake")
    assert codec.request_decoder.decode(letter.payload, codec.encoding_of(letter.headers)).model == "not-fake"


@pytest.mark.parametrize(
    "body, code, field",
    [
        pytest.param({"surprise": 1}, ErrorCode.INVALID_REQUEST, "$.surprise", id="an unknown field"),
        pytest.param({"v": 7}, ErrorCode.UNSUPPORTED_VERSION, "$.v", id="a version it does not speak"),
        pytest.param({"model": "not-fake"}, ErrorCode.MODEL_NOT_SERVED, "$.model", id="another model"),
    ],
)
async def test_a_shard_that_cannot_run_fails_each_request_it_names_and_the_worker_goes_on(
    nats_url, namespace, body, code, field
):
    async with Client(nats_url, namespace=namespace) as client:
        ids = [f"bad-{code.value}-{i}" for i in range(3)]
        shard = ShardJob(request_id=f"bad-{code.value}", model="fake", requests=[_request(r) for r in ids])
        raw = {**msgspec.to_builtins(shard), **body}
        engine = finishing_engine()
        async with inproc_worker(nats_url, engine, namespace=namespace, slots=32):
            await client.js.publish(
                client.names.jobs(SHARD_QUEUE, "fake"),
                json.dumps(raw).encode(),
                headers={codec.CONTENT_TYPE: codec.JSON},
            )
            results = await _results(client, ids)
            ok = ShardJob(
                request_id=f"after-{code.value}", model="fake", requests=[_request(f"after-{code.value}")]
            )
            await client.submit_shard(ok)  # the worker serves the next shard
            after = await _results(client, [f"after-{code.value}"])
        dead = await client.js.get_last_msg(client.names.dlq_stream, client.names.dlq("generate", "fake"))
    for rid in ids:
        err = results[rid].error
        assert isinstance(err, ErrorFrame) and err.code == code and err.field == field, err
    assert not set(engine.finished) & set(ids)
    assert after[f"after-{code.value}"].final is not None
    assert dead.data and code.value in dead.data.decode(errors="replace")


async def test_a_draining_worker_hands_its_shard_back_and_the_next_runs_only_the_unfinished_lines(
    nats_url, namespace
):
    async with Client(nats_url, namespace=namespace) as client:
        ids = [f"drain-{i}" for i in range(16)]
        requests = [
            msgspec.structs.replace(
                _request(r), stop=StopConditions(max_tokens=2 if i < 8 else 400, ignore_eos=True)
            )
            for i, r in enumerate(ids)
        ]
        first, second = (
            finishing_engine(step_delay=0.01, max_model_len=1024),
            finishing_engine(max_model_len=1024),
        )
        async with inproc_worker(nats_url, first, namespace=namespace, slots=32, grace_period=0.2):
            await client.submit_shard(
                ShardJob(request_id="drained", model="fake", requests=requests, fresh=True)
            )
            short = await _results(client, ids[:8])  # the short ones end; the long ones still run
        assert all(r.final is not None for r in short.values())
        async with inproc_worker(nats_url, second, namespace=namespace, slots=32):
            results = await _results(client, ids)
    assert set(second.finished) == set(ids[8:])  # the short lines ended: never run again
    assert all(results[rid].final is not None for rid in ids)
    assert all(results[rid].final.choices[0].completion_tokens == 400 for rid in ids[8:])  # type: ignore[union-attr]


async def test_a_chat_line_in_a_shard_gives_what_it_gives_as_a_job_of_its_own(nats_url, namespace):
    prompt = ChatPrompt(messages=[ChatMessage(role="user", content="hello")])
    async with Client(nats_url, namespace=namespace) as client:
        async with inproc_worker(nats_url, finishing_engine(), namespace=namespace, slots=32):
            alone = await client.complete(msgspec.structs.replace(_request("alone"), prompt=prompt))
            await client.submit_shard(
                ShardJob(
                    request_id="one-chat",
                    model="fake",
                    requests=[
                        msgspec.structs.replace(_request("in-shard"), prompt=prompt),
                        _request("filler"),
                    ],
                )
            )
            shard = (await _results(client, ["in-shard"]))["in-shard"]
    assert shard.final is not None and shard.token_ids[0] == alone.token_ids
    assert shard.text is not None and shard.text[0] == alone.text


async def test_a_shard_jetstream_gives_up_on_fails_each_of_its_requests_that_had_not_ended(
    nats_url, namespace
):
    """JetStream delivered the shard max_deliver times and nobody finished it (here a stalled
    consumer takes it and never acks): its requests' submitter is still owed their results."""
    policy = QueuePolicy(ack_wait=1.0, max_deliver=2)
    async with Client(nats_url, namespace=namespace) as client:
        ids = [f"gave-up-{i}" for i in range(3)]
        await client.js.publish(client.names.request_log(ids[0]), codec.encode(_stored(ids[0])))
        async with inproc_worker(
            nats_url, FakeEngine(), namespace=namespace, slots=32, policy=policy, pull_expires=1.0
        ) as w:
            w.slots.pause(True)
            await anyio.sleep(1.5)  # the worker's outstanding pull requests expire
            stalled = await client.js.pull_subscribe_bind(
                durable=client.names.consumer(SHARD_QUEUE, "fake"), stream=client.names.jobs_stream
            )
            try:
                await client.submit_shard(
                    ShardJob(request_id="given-up", model="fake", requests=[_request(r) for r in ids])
                )
                for _ in range(2):
                    await stalled.fetch(1, timeout=10)  # taken, never acked
                with pytest.raises(nats.errors.TimeoutError):
                    await stalled.fetch(1, timeout=3)  # no further delivery: JetStream gave up
                results = await _results(client, ids)
            finally:
                await stalled.unsubscribe()
    assert results[ids[0]].worker == "earlier"  # it had ended: left as it was
    for rid in ids[1:]:
        err = results[rid].error
        assert err is not None and err.code == ErrorCode.DELIVERIES_EXHAUSTED and err.request_id == rid


async def test_a_delivery_whose_request_a_newer_one_took_over_does_not_settle_the_shard(nats_url, namespace):
    """A newer delivery of the shard runs that request now (the first worker seemed dead): an ack
    from the older delivery would leave the request to nobody should the newer one's worker die."""
    async with Client(nats_url, namespace=namespace) as client:
        ids = ["quick-0", "quick-1", "slow"]
        requests = [_request(r) for r in ids[:2]]
        slow = StopConditions(max_tokens=200, ignore_eos=True)
        requests.append(msgspec.structs.replace(_request("slow"), stop=slow))
        engine = finishing_engine(step_delay=0.02)
        async with inproc_worker(nats_url, engine, namespace=namespace, slots=32):
            await client.submit_shard(
                ShardJob(request_id="taken-over", model="fake", requests=requests, fresh=True)
            )
            await _results(client, ids[:2])
            # what a worker taking the request over sends: every attempt below its own stops
            await client.nc.publish(
                client.names.cancel("slow"),
                codec.encode(CancelRequest(request_id="slow", reason="superseded", below_attempt=2)),
            )
            with anyio.fail_after(10):
                while "slow" in engine.running:
                    await anyio.sleep(0.02)
            await anyio.sleep(0.5)
            info = await client.js.consumer_info(
                client.names.jobs_stream, client.names.consumer(SHARD_QUEUE, "fake")
            )
        assert info.num_ack_pending == 1  # neither acked nor handed back: the newer delivery's to settle
        assert "slow" not in engine.finished


async def test_a_shard_given_up_on_spares_the_requests_a_live_worker_still_runs(nats_url, namespace):
    """Its copy of a request that another job runs (a runner that took a batch over queues its
    lines again): that job ends it, and an error stored meanwhile would be the line's answer."""
    from jetllm.schemas import Claim
    from jetllm.workers.shards import fail_requests

    async with Client(nats_url, namespace=namespace) as client:
        names = client.names
        ids = ["ended", "running-elsewhere", "died-elsewhere", "never-started"]
        await client.js.publish(names.request_log("ended"), codec.encode(_stored("ended")))
        for rid, worker in (("running-elsewhere", "alive"), ("died-elsewhere", "gone")):
            claim = Claim(attempt=1, worker=worker, at=0.0)
            await client.js.publish(names.request_log(rid), codec.encode(claim))

        async def alive(msg) -> None:
            await client.nc.publish(msg.reply, b"running" if msg.data == b"running-elsewhere" else b"idle")

        await client.nc.subscribe(names.instance_control("alive", "ping"), cb=alive)
        async with inproc_worker(nats_url, FakeEngine(), namespace=namespace, slots=32) as w:
            shard = ShardJob(request_id="given", model="fake", requests=[_request(r) for r in ids])
            err = ErrorFrame(seq=1, request_id=None, code=ErrorCode.DELIVERIES_EXHAUSTED, message="gave up")
            left = await fail_requests(w.ctx, w.log, codec.encode(shard), "msgpack", err, 1)
        results = {rid: await client.result(rid) for rid in ids}
    assert left == []
    assert results["ended"] is not None and results["ended"].worker == "earlier"
    assert results["running-elsewhere"] is None  # left to the job that runs it
    for rid in ("died-elsewhere", "never-started"):
        r = results[rid]
        assert r is not None and r.error is not None and r.error.code == ErrorCode.DELIVERIES_EXHAUSTED


@pytest.mark.parametrize(
    "headers, held",
    [
        (None, 1),
        ({"Jetllm-Requests": "40"}, 40),
        ({"Jetllm-Requests": "x"}, 1),
        ({"Jetllm-Requests": "-3"}, 1),
        ({"Jetllm-Requests": "99999"}, 1024),
    ],
)
def test_a_shard_holds_the_slots_its_header_announces_on_arrival_within_bounds(headers, held):
    from jetllm.workers.shards import announced

    assert announced(headers) == held
