"""`jetllm dlq`: dead letters are listed, shown, and replayed once the cause is fixed."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import anyio
import msgspec
import nats.errors
import pytest

from jetllm import tinymodel
from jetllm.errors import RequestFailed
from jetllm.producer import Client
from jetllm.producer.lora import LoraAdmin
from jetllm.schemas import ErrorCode, TokensPrompt
from jetllm.subjects.codec import HEADER_MARGIN
from jetllm.subjects.policy import QueuePolicy
from jetllm.workers.lora import LoraSettings

from .conftest import inproc_worker
from .fake_engine import FakeEngine
from .jobs import consumer_counts, req, wait_dead_letter
from .test_lora_plane import TINY_FACTS

pytestmark = pytest.mark.anyio


def jetllm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jetllm", *args], capture_output=True, text=True, timeout=60)


async def test_list_show_and_replay_after_the_cause_is_fixed(nats_url, namespace):
    long_prompt = [i % 90 + 1 for i in range(100)]
    async with Client(nats_url, namespace=namespace) as c:
        async with inproc_worker(nats_url, FakeEngine(max_model_len=64), namespace=namespace):
            with pytest.raises(RequestFailed):
                await c.complete(req("fake", long_prompt, max_tokens=5, request_id="too-long-1"))
        await wait_dead_letter(c.nc, c.names, lambda d: d.request_id == "too-long-1")

        common = ["--nats", nats_url, "--namespace", namespace]
        listed = await anyio.to_thread.run_sync(lambda: jetllm("dlq", "list", *common, "--json"))
        (row,) = [json.loads(x) for x in listed.stdout.splitlines()]
        assert row["code"] == "context_length_exceeded" and row["request_id"] == "too-long-1"
        shown = await anyio.to_thread.run_sync(lambda: jetllm("dlq", "show", *common, str(row["seq"])))
        assert json.loads(shown.stdout)["payload"]["prompt"]["token_ids"] == long_prompt

        async with inproc_worker(nats_url, FakeEngine(max_model_len=1000), namespace=namespace):
            replayed = await anyio.to_thread.run_sync(
                lambda: jetllm("dlq", "replay", *common, str(row["seq"]))
            )
            assert replayed.returncode == 0, replayed.stderr
            result = await c.wait_result("too-long-1", timeout=20)
        assert result.final is not None and len(result.token_ids[0]) == 5
        after = await anyio.to_thread.run_sync(lambda: jetllm("dlq", "list", *common, "--json"))
        assert after.stdout.strip() == ""  # replayed records leave the stream
        assert ErrorCode.CONTEXT_LENGTH_EXCEEDED.value in shown.stdout


@pytest.mark.parametrize("queue", ["model", "adapter"])
async def test_a_job_no_worker_finishes_is_dead_lettered_and_its_producer_told(
    nats_url, namespace, tmp_path, queue
):
    """JetStream gives up after max_deliver deliveries (here: a stalled consumer that never acks);
    the producer still gets one clear error, and the job waits in the dead-letter stream. Also for
    a job naming an adapter as its model, which waits in the adapter's own queue."""
    policy = QueuePolicy(ack_wait=1.0, max_deliver=2)
    engine = FakeEngine()
    lora = LoraSettings()
    if queue == "adapter":
        engine.facts.lora = TINY_FACTS
        tinymodel.build_lora(tmp_path / "allowed" / "a", seed=1)
        lora = LoraSettings(dirs=[str(tmp_path / "allowed")], cache_dir=str(tmp_path / "cache"), load_wait=5)
    model = "a" if queue == "adapter" else "fake"
    request = req(model, max_tokens=4)
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=60) as c:
        async with inproc_worker(
            nats_url, engine, namespace=namespace, policy=policy, pull_expires=1.0, lora=lora
        ) as w:
            if queue == "adapter":
                admin = LoraAdmin(c.nc, c.names, timeout=10)
                with anyio.fail_after(10):
                    while not (await admin.list("fake")).replies:
                        await anyio.sleep(0.05)
                await admin.load("fake", "a", source="path", ref=str(tmp_path / "allowed" / "a"))
                with anyio.fail_after(10):
                    while not w.adapter_queues.serves("a"):
                        await anyio.sleep(0.05)
            err = await run_out_of_deliveries(c, w, model, request, deliveries=2)
            dead = await wait_dead_letter(c.nc, c.names, lambda d: d.request_id == request.request_id)
            assert w.counters.dead_lettered == 1
        assert err.code == ErrorCode.DELIVERIES_EXHAUSTED and "2 times" in err.remote_message
        assert dead.code == ErrorCode.DELIVERIES_EXHAUSTED and dead.deliveries == 2
        assert dead.subject == c.names.jobs("generate", model)  # a replay goes back to the same queue
        stored = await c.result(request.request_id)
        assert stored is not None and stored.error is not None
        assert stored.error.code == ErrorCode.DELIVERIES_EXHAUSTED


async def test_a_job_near_max_payload_that_runs_out_of_deliveries_is_dead_lettered(nats_url, namespace):
    """A job that nearly fills a message leaves no room for its dead letter to carry it as well:
    the dead letter keeps the reason and says the payload was not kept, rather than failing to be
    stored and leaving the job in the queue and its producer without an answer."""
    policy = QueuePolicy(ack_wait=1.0, max_deliver=2)
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=60) as c:
        # As big as a producer may send: the longest request id, and token ids (one msgpack byte
        # each below 128) up to the limit once generate() has set a reply subject of this length.
        limit = c.nc.max_payload - HEADER_MARGIN
        reply = f"_INBOX.{uuid.uuid4().hex}.{uuid.uuid4().hex}"
        small = req("fake", [1], max_tokens=4, request_id="r-" + "x" * 198, reply_to=reply)
        pad = limit - len(c.encode_job(small)) - 8  # the token list's msgpack header grows by 4 bytes
        big = msgspec.structs.replace(small, prompt=TokensPrompt([1] * pad))
        assert limit - 8 < len(c.encode_job(big)) <= limit
        request = msgspec.structs.replace(big, reply_to=None)
        async with inproc_worker(
            nats_url, FakeEngine(), namespace=namespace, policy=policy, pull_expires=1.0
        ) as w:
            err = await run_out_of_deliveries(c, w, "fake", request, deliveries=2)
            dead = await wait_dead_letter(c.nc, c.names, lambda d: d.request_id == request.request_id)
            assert w.counters.dead_lettered == 1
        assert err.code == ErrorCode.DELIVERIES_EXHAUSTED
        assert dead.code == ErrorCode.DELIVERIES_EXHAUSTED and dead.payload == b""
        assert "not kept: too big for a dead letter" in dead.reason
        assert dead.subject == c.names.jobs("generate", "fake")
        (pending, in_flight) = await consumer_counts(c.nc, c.names, "fake")
        assert (pending, in_flight) == (0, 0)  # the job left the queue


async def run_out_of_deliveries(c: Client, w, model: str, request, deliveries: int) -> RequestFailed:
    """Let a stalled consumer take `request` `deliveries` times without acking it, while the worker
    only listens for JetStream's advisory; returns the error its producer got."""
    w.slots.pause(True)
    await anyio.sleep(1.5)  # the worker's outstanding pull requests expire
    stalled = await c.js.pull_subscribe_bind(
        durable=c.names.consumer("generate", model), stream=c.names.jobs_stream
    )
    failed: list[RequestFailed] = []

    async def produce() -> None:
        with pytest.raises(RequestFailed) as info:
            await c.complete(request)
        failed.append(info.value)

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                for delivery in range(1, deliveries + 1):
                    (msg,) = await stalled.fetch(1, timeout=10)  # taken, never acked
                    assert msg.metadata.num_delivered == delivery
                with pytest.raises(nats.errors.TimeoutError):
                    await stalled.fetch(1, timeout=3)  # no further delivery
    finally:
        await stalled.unsubscribe()
    (err,) = failed
    return err
