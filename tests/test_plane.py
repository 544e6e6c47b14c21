"""The message plane against a real nats-server, with the light test engine (fast).

Every behaviour here that depends on the engine is also covered against real vLLM in
test_vllm_*.py; the error paths run against both engines (see test_bad_jobs.py).
"""

from __future__ import annotations

import uuid
from contextlib import aclosing

import anyio
import msgspec
import nats.errors
import nats.js.errors
import pytest

from jetllm.errors import AcceptTimeout, PayloadTooLarge, RequestFailed, WorkerSilent
from jetllm.producer import Client
from jetllm.schemas import (
    AcceptedFrame,
    ChatMessage,
    ChatPrompt,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    GenerateRequest,
    Record,
    Result,
    SamplingOptions,
    StopConditions,
    TextPrompt,
    TokensFrame,
    TokensPrompt,
)
from jetllm.subjects import QueuePolicy, codec
from jetllm.subjects.names import ROLES
from jetllm.workers.roles import GenerateRole
from jetllm.workers.runtime import EXIT_ENGINE_DEAD, EXIT_OK

from .conftest import inproc_worker
from .fake_engine import FakeEngine
from .jobs import RawInbox, consumer_counts, publish_raw, req

pytestmark = pytest.mark.anyio


async def test_frames_arrive_in_order_and_end_with_usage(nats_url, client, fake_engine):
    async with inproc_worker(nats_url, fake_engine, namespace=client.names.namespace) as worker:
        frames = [f async for f in client.generate(req("fake", [1, 2, 3], max_tokens=6))]
    assert isinstance(frames[0], AcceptedFrame) and frames[0].worker == worker.instance
    assert isinstance(frames[-1], FinalFrame)
    assert frames[0].seq == 0  # accepted carries the last seq sent: none yet
    assert [f.seq for f in frames[1:]] == list(range(1, len(frames)))
    tokens = [t for f in frames if isinstance(f, TokensFrame) for t in f.token_ids]
    assert len(tokens) == 6
    final = frames[-1]
    assert final.usage.prompt_tokens == 3 and final.usage.completion_tokens == 6
    assert final.choices[0].finish_reason == "length"


async def test_a_finished_requests_log_keeps_its_result_alone(nats_url, client, fake_engine):
    """The result rolls the request's log up as it is stored: its claim goes, no purge needed."""
    request = req("fake", [1, 2, 3], max_tokens=6)
    async with inproc_worker(nats_url, fake_engine, namespace=client.names.namespace):
        done = await client.complete(request)
    subject = client.names.request_log(request.request_id)
    info = await client.js.stream_info(client.names.requests_stream, subjects_filter=subject)
    assert info.state.subjects == {subject: 1}
    last = await client.js.get_last_msg(client.names.requests_stream, subject)
    result = codec.KindDecoder(Record).decode(last.data)
    assert isinstance(result, Result) and result.token_ids == [done.token_ids]


async def test_a_stream_that_refuses_rollups_still_gets_the_result(nats_url, client, fake_engine):
    """Someone turned rollups off after the worker started: the result is stored beside the log."""
    import dataclasses

    js, stream = client.js, client.names.requests_stream
    async with inproc_worker(nats_url, fake_engine, namespace=client.names.namespace):
        config = (await js.stream_info(stream)).config
        await js.update_stream(dataclasses.replace(config, allow_rollup_hdrs=False))
        request = req("fake", [1, 2, 3], max_tokens=4)
        done = await client.complete(request)
    subject = client.names.request_log(request.request_id)
    info = await js.stream_info(stream, subjects_filter=subject)
    assert info.state.subjects == {subject: 2}  # its claim stays
    result = codec.KindDecoder(Record).decode((await js.get_last_msg(stream, subject)).data)
    assert isinstance(result, Result) and result.token_ids == [done.token_ids]


@pytest.mark.parametrize(
    ("attached", "detached_interval", "checkpointed"),
    [
        (True, 5.0, True),  # a producer listens: its tokens are checkpointed every --checkpoint-interval
        (False, 5.0, False),  # nobody listens: not before --detached-checkpoint-interval
        (False, 0.2, True),
    ],
)
async def test_a_detached_jobs_tokens_are_checkpointed_at_their_own_interval(
    nats_url, client, attached, detached_interval, checkpointed
):
    """What a reader of the log (`Client.attach`, a worker taking the job over) finds while it runs."""
    request = req("fake", [1, 2, 3], max_tokens=150)  # about 3 s at 20 ms a token
    subject = client.names.request_log(request.request_id)
    async with inproc_worker(
        nats_url,
        FakeEngine(step_delay=0.02),
        namespace=client.names.namespace,
        checkpoint_interval=0.2,
        detached_checkpoint_interval=detached_interval,
    ):
        async with anyio.create_task_group() as tg:
            if attached:
                tg.start_soon(client.complete, request)
            else:
                await client.submit(request)

            async def records() -> int:
                info = await client.js.stream_info(client.names.requests_stream, subjects_filter=subject)
                return (info.state.subjects or {}).get(subject, 0)

            with anyio.fail_after(10):
                while await records() == 0:  # its claim
                    await anyio.sleep(0.02)
            await anyio.sleep(1.0)
            assert (await records() > 1) is checkpointed
        result = await client.wait_result(request.request_id, timeout=20)
    assert len(result.token_ids[0]) == 150


async def test_complete_assembles_text_for_chat_and_text_prompts(nats_url, client, fake_engine):
    async with inproc_worker(nats_url, fake_engine, namespace=client.names.namespace):
        chat = await client.complete(
            GenerateRequest(
                request_id="chat-1",
                model="fake",
                prompt=ChatPrompt([ChatMessage(role="user", content="hi")]),
                stop=StopConditions(max_tokens=4, ignore_eos=True),
            )
        )
        text = await client.complete(
            GenerateRequest(
                request_id="text-1",
                model="fake",
                prompt=TextPrompt("hello"),
                stop=StopConditions(max_tokens=4, ignore_eos=True),
            )
        )
        tokens = await client.complete(req("fake", [1, 2], max_tokens=4))
    assert chat.text == "".join(f"<{t}>" for t in chat.token_ids)
    assert text.text is not None and len(text.token_ids) == 4
    assert tokens.text is None  # token prompts get no text unless asked


async def test_n_choices_each_get_their_tokens_and_finish(nats_url, client, fake_engine):
    async with inproc_worker(nats_url, fake_engine, namespace=client.names.namespace):
        done = await client.complete(
            req("fake", [3, 4], max_tokens=5, sampling=SamplingOptions(n=3, temperature=1))
        )
    assert [len(c.token_ids) for c in done.choices] == [5, 5, 5]
    assert len({tuple(c.token_ids) for c in done.choices}) == 3
    assert done.usage.completion_tokens == 15


async def test_json_job_from_a_foreign_producer_gets_json_frames(nats_url, client, fake_engine):
    """What a producer in another language, or the `nats` CLI, would do: JSON bytes plus a header."""
    async with inproc_worker(nats_url, fake_engine, namespace=client.names.namespace):
        async with RawInbox(client.nc, encoding="json") as inbox:
            body = (
                '{"v": 1, "request_id": "json-1", "model": "fake", '
                '"prompt": {"type": "tokens", "token_ids": [9, 8]}, '
                '"stop": {"max_tokens": 3, "ignore_eos": true}, '
                f'"reply_to": "{inbox.subject}"}}'
            ).encode()
            await publish_raw(client.nc, client.names, "fake", body, {"Content-Type": "application/json"})
            frames = await inbox.until_end()
    assert isinstance(frames[-1], FinalFrame) and frames[-1].usage.completion_tokens == 3


async def test_payload_over_server_max_is_refused_before_publishing(nats_url, client, fake_engine):
    big = GenerateRequest(
        request_id="big-1",
        model="fake",
        prompt=TextPrompt("x" * (client.nc.max_payload + 10)),
    )
    with pytest.raises(PayloadTooLarge, match="max_payload"):
        await client.submit(big)
    async with inproc_worker(nats_url, fake_engine, namespace=client.names.namespace):
        assert (await client.complete(req("fake", max_tokens=2))).finish_reason == "length"
    pending, _ = await consumer_counts(client.nc, client.names, "fake")
    assert pending == 0


async def test_a_role_without_workers_is_refused_naming_the_roles_there_are(client):
    """A job on a queue no worker consumes would wait unseen until it expires: refused instead."""
    with pytest.raises(ValueError, match=r"role 'prefill' has no workers; jobs can go to: generate"):
        await client.submit(req("fake"), role="prefill")
    with pytest.raises(ValueError, match=r"role 'encode' has no workers"):
        async for _ in client.generate(req("fake"), role="encode"):
            pass
    assert (await client.js.stream_info(client.names.jobs_stream)).state.messages == 0


def test_every_role_producers_may_use_has_workers():
    assert ROLES == (GenerateRole.queue,)


async def test_job_published_while_no_worker_runs_is_served_when_one_starts(nats_url, client, fake_engine):
    results = []

    async def produce() -> None:
        results.append(await client.complete(req("fake", max_tokens=3)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        await anyio.sleep(1.0)
        assert results == []
        async with inproc_worker(nats_url, fake_engine, namespace=client.names.namespace):
            with anyio.fail_after(10):
                while not results:
                    await anyio.sleep(0.02)
    assert len(results[0].token_ids) == 3


async def test_accept_timeout_when_no_worker_serves_the_model(client):
    with pytest.raises(AcceptTimeout):
        async for _ in client.generate(req("nobody-serves-this"), accept_timeout=0.5):
            pass


async def test_accept_timeout_also_for_a_request_id_already_queued(client):
    """generate() on a request submitted before follows that job: accept_timeout still bounds the
    wait for a worker to take it, instead of waiting forever."""
    queued = req("nobody-serves-this")
    await client.submit(queued)
    with anyio.fail_after(30), pytest.raises(AcceptTimeout):  # it waited forever before
        async for _ in client.generate(queued, accept_timeout=0.5):
            pass


async def test_worker_never_holds_more_jobs_than_its_slots(nats_url, client):
    engine = FakeEngine(step_delay=0.01)
    async with inproc_worker(nats_url, engine, namespace=client.names.namespace, slots=4):
        peak_held = peak_waiting = 0
        results = []

        async def one(i: int) -> None:
            results.append(await client.complete(req("fake", [i + 1], max_tokens=10)))

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(one, i)

            async def watch() -> None:
                nonlocal peak_held, peak_waiting
                while len(results) < 20:
                    waiting, held = await consumer_counts(client.nc, client.names, "fake")
                    peak_held, peak_waiting = max(peak_held, held), max(peak_waiting, waiting)
                    await anyio.sleep(0.01)

            tg.start_soon(watch)
    assert len(results) == 20 and all(len(r.token_ids) == 10 for r in results)
    assert 0 < peak_held <= 4
    assert peak_waiting > 0  # the backlog stayed in JetStream


async def _leave_after_tokens(client: Client, request: GenerateRequest, tokens: int) -> None:
    """Streams `request` until `tokens` token frames came, then leaves the loop (which cancels it)."""
    seen = 0
    async with aclosing(client.generate(request)) as frames:
        async for frame in frames:
            if isinstance(frame, TokensFrame):
                seen += 1
                if seen == tokens:
                    break


async def test_cancelling_the_iteration_aborts_the_request_and_frees_the_slot(nats_url, client):
    engine = FakeEngine(step_delay=0.02, max_model_len=100_000)
    async with inproc_worker(nats_url, engine, namespace=client.names.namespace, slots=1) as worker:
        long = req("fake", max_tokens=50_000)
        await _leave_after_tokens(client, long, 3)
        with anyio.fail_after(5):  # the slot frees once the cancelled request is settled
            while long.request_id not in engine.aborted or worker.status().in_flight:
                await anyio.sleep(0.01)
        # the only slot is free again: the next request runs
        assert (await client.complete(req("fake", max_tokens=2))).finish_reason == "length"
        assert worker.counters.cancelled == 1


async def test_a_producer_whose_first_puback_was_lost_still_owns_its_request(nats_url, client, monkeypatch):
    """A busy server can store a job and answer too late: the retry's PubAck then says "duplicate".
    The request is still this producer's: it streams, and leaving the stream cancels it."""
    engine = FakeEngine(step_delay=0.02, max_model_len=100_000)
    publish, lost = client.js.publish, []

    async def late_puback(subject, payload=b"", *args, **kwargs):
        ack = await publish(subject, payload, *args, **kwargs)
        if subject == client.names.jobs("generate", "fake") and not lost:
            lost.append(ack)
            raise nats.errors.TimeoutError
        return ack

    monkeypatch.setattr(client.js, "publish", late_puback)
    async with inproc_worker(nats_url, engine, namespace=client.names.namespace):
        long = req("fake", max_tokens=50_000)
        await _leave_after_tokens(client, long, 3)
        assert lost, "the first PubAck was not dropped"
        with anyio.fail_after(5):
            while long.request_id not in engine.aborted:
                await anyio.sleep(0.01)
    assert (await client.submit(long)).duplicate  # a later submit of the same id is a duplicate


async def test_a_duplicate_after_an_attempt_that_stored_nothing_is_still_a_duplicate(client, monkeypatch):
    """While a stream's leader moves, nothing answers ("no response from stream"): that attempt
    stored nothing, so a duplicate after it is an earlier submitter's job, not this call's."""
    first = req("fake", max_tokens=2)
    await client.submit(first)  # an earlier submitter; no worker runs here, so it stays queued
    publish, refused = client.js.publish, []

    async def no_stream_at_first(subject, payload=b"", *args, **kwargs):
        if not refused:
            refused.append(subject)
            raise nats.js.errors.NoStreamResponseError
        return await publish(subject, payload, *args, **kwargs)

    monkeypatch.setattr(client.js, "publish", no_stream_at_first)
    assert (await client.submit(first)).duplicate and refused


async def test_cancel_from_another_task_reaches_the_worker(nats_url, client):
    engine = FakeEngine(step_delay=0.02, max_model_len=100_000)
    async with inproc_worker(nats_url, engine, namespace=client.names.namespace):
        long = req("fake", max_tokens=50_000)
        generating = anyio.Event()

        async def listen() -> None:
            async for frame in client.generate(long):
                if isinstance(frame, TokensFrame):
                    generating.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(listen)
            with anyio.fail_after(10):
                await generating.wait()
            tg.cancel_scope.cancel()  # the listening task is cancelled, not told to stop
        with anyio.fail_after(5):
            while long.request_id not in engine.aborted:
                await anyio.sleep(0.01)


async def test_heartbeats_keep_a_quiet_request_alive(nats_url, nats_url_client_short_hb):
    c = nats_url_client_short_hb
    engine = FakeEngine(step_delay=0.01)
    async with inproc_worker(nats_url, engine, namespace=c.names.namespace, heartbeat_interval=0.1):
        async with anyio.create_task_group() as tg:

            async def unstall() -> None:
                await anyio.sleep(1.5)
                engine.stalled = False

            engine.stalled = True
            tg.start_soon(unstall)
            done = await c.complete(req("fake", max_tokens=3))
    assert len(done.token_ids) == 3


async def test_a_silent_worker_is_reported_when_migration_is_off(nats_url, namespace):
    engine = FakeEngine()
    engine.stalled = True
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=0.5, migrate=False) as c:
        async with inproc_worker(
            nats_url, engine, namespace=namespace, heartbeat_interval=60, grace_period=0.5
        ):
            with pytest.raises(WorkerSilent, match="no frame"):
                await c.complete(req("fake", max_tokens=3))


@pytest.fixture
async def nats_url_client_short_hb(nats_url, namespace):
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=0.5) as c:
        yield c


async def test_graceful_stop_finishes_running_jobs_and_leaves_queued_ones(nats_url, client):
    engine = FakeEngine(step_delay=0.01)
    results: list = []

    async def one(i: int) -> None:
        results.append(await client.complete(req("fake", [i + 1], max_tokens=40)))

    async with anyio.create_task_group() as tg:
        async with inproc_worker(nats_url, engine, namespace=client.names.namespace, slots=8) as first:
            engine.stalled = True  # none of the 8 may finish (and free a slot for the 9th) before the stop
            for i in range(9):
                tg.start_soon(one, i)
            with anyio.fail_after(10):
                while first.status().in_flight < 8:
                    await anyio.sleep(0.01)
            first.stop()  # what SIGTERM does
            with anyio.fail_after(5):
                while first.state != "draining":
                    await anyio.sleep(0.01)
            engine.stalled = False
            with anyio.fail_after(20):
                while first.state != "stopped" or len(results) < 8:
                    await anyio.sleep(0.01)
            assert first.exit_code == EXIT_OK
            assert first.counters.pulled == 8 and first.counters.handed_back == 0
            assert len(results) == 8
        async with inproc_worker(nats_url, FakeEngine(), namespace=client.names.namespace) as second:
            with anyio.fail_after(10):  # the result reaches the client just before the worker acks
                while len(results) < 9 or second.counters.acked < 1:
                    await anyio.sleep(0.01)
            assert second.counters.acked == 1
    assert all(len(r.token_ids) == 40 for r in results)


async def test_grace_period_over_hands_jobs_back_for_another_worker(nats_url, client):
    """ack_wait is far longer than the test may take: only an explicit hand-back lets worker 2 run it."""
    slow = FakeEngine(step_delay=0.05, max_model_len=10_000)
    await client.submit(req("fake", [1], max_tokens=200))
    policy = QueuePolicy(ack_wait=300)
    async with inproc_worker(
        nats_url, slow, namespace=client.names.namespace, grace_period=0.3, policy=policy
    ) as first:
        with anyio.fail_after(10):
            while first.status().in_flight < 1:
                await anyio.sleep(0.01)
        first.stop()
        with anyio.fail_after(20):
            while first.state != "stopped":
                await anyio.sleep(0.01)
        assert first.counters.handed_back == 1 and first.counters.acked == 0
    async with inproc_worker(
        nats_url, FakeEngine(), namespace=client.names.namespace, policy=policy
    ) as second:
        with anyio.fail_after(30):
            while second.counters.acked < 1:
                await anyio.sleep(0.02)


async def test_engine_death_hands_jobs_back_and_exits_nonzero(nats_url, client):
    engine = FakeEngine(step_delay=0.02, max_model_len=10_000)
    await client.submit(req("fake", max_tokens=5000))
    policy = QueuePolicy(ack_wait=300)
    async with inproc_worker(
        nats_url, engine, namespace=client.names.namespace, health_interval=0.1, policy=policy
    ) as w:
        with anyio.fail_after(10):
            while not engine.running:
                await anyio.sleep(0.01)
        engine.dead = True
        with anyio.fail_after(10):
            while w.state not in ("engine_dead", "stopped"):
                await anyio.sleep(0.01)
    assert w.exit_code == EXIT_ENGINE_DEAD
    assert w.counters.handed_back == 1
    survivor = FakeEngine(max_model_len=10_000)
    async with inproc_worker(nats_url, survivor, namespace=client.names.namespace, policy=policy) as second:
        with anyio.fail_after(30):
            while second.counters.acked < 1:
                await anyio.sleep(0.02)


async def test_request_for_a_model_the_worker_does_not_serve(nats_url, client, fake_engine):
    async with inproc_worker(nats_url, fake_engine, namespace=client.names.namespace):
        async with RawInbox(client.nc) as inbox:
            wrong = msgspec.structs.replace(req("other-model"), reply_to=inbox.subject)
            await publish_raw(client.nc, client.names, "fake", codec.encode(wrong))
            frames = await inbox.until_end()
    assert isinstance(frames[-1], ErrorFrame) and frames[-1].code == ErrorCode.MODEL_NOT_SERVED


async def test_context_limits_name_the_limit(nats_url, client):
    engine = FakeEngine(max_model_len=64)
    async with inproc_worker(nats_url, engine, namespace=client.names.namespace):
        with pytest.raises(RequestFailed) as long_prompt:
            await client.complete(req("fake", list(range(1, 80))))
        with pytest.raises(RequestFailed) as too_many:
            await client.complete(req("fake", [1, 2, 3], max_tokens=100))
        fits = await client.complete(
            GenerateRequest(
                request_id=f"fit-{uuid.uuid4().hex}",
                model="fake",
                prompt=TokensPrompt([1, 2, 3]),
                stop=StopConditions(ignore_eos=True),
            )
        )
    assert long_prompt.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED and "64" in str(long_prompt.value)
    assert (
        too_many.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
        and too_many.value.field == "$.stop.max_tokens"
    )
    assert len(fits.token_ids) == 64 - 3  # max_tokens defaults to the room left
