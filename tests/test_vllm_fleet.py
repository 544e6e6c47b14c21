"""The fleet control plane against a real vLLM worker process: its KV-cache events read back from
JetStream as a router would, registry record and its expiry, `jetllm status`, health with a
canary, Prometheus metrics under load, prefix-cache reset, sleep and wake, and health once the
engine is dead.

Both tests use one worker (one engine start-up), in file order: the KV-event test needs the
worker's first events, the control-plane test ends by killing its engine."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jetllm.producer import Client
from jetllm.producer.fleet import ask
from jetllm.producer.kvevents import kv_events
from jetllm.producer.registry import instances
from jetllm.schemas import (
    ControlDone,
    ControlFailed,
    ErrorCode,
    HealthReport,
    KvCleared,
    KvEventBatch,
    KvStored,
    StopConditions,
)
from jetllm.subjects import codec
from jetllm.subjects.streams import RECORD_TTL

from .conftest import TINY, WorkerProcess, require_vllm
from .jobs import kv_batches, kv_blocks, req

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

BLOCK = 32
_reply = codec.Decoder(ControlDone | ControlFailed)


@pytest.fixture(scope="module")
def worker(nats_url, tiny_model, tmp_path_factory) -> Iterator[WorkerProcess]:
    """KV events on (the default), registry records every 0.5 s, no health checks of its own (the
    engine is killed under it at the end)."""
    require_vllm()
    w = WorkerProcess(
        nats_url,
        f"fl{uuid.uuid4().hex[:8]}",
        tiny_model,
        tmp_path_factory.mktemp("fleet") / "worker.log",
        "--slots",
        "8",
        "--registry-interval",
        "0.5",
        "--health-interval",
        "600",
    )
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(anyio.run, w.wait_ready, nats_url).result()
        yield w
    finally:
        w.stop()


def stored_blocks(batches: list[KvEventBatch]) -> list[tuple[int, int | None, list[int]]]:
    """(hash, parent, tokens) of every block the batches store, in order (snapshots left out)."""
    out = []
    for b in batches:
        if b.resync is not None:
            continue
        for ev in b.events:
            if isinstance(ev, KvStored):
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    out.append((h, parent, ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]))
                    parent = h
    return out


async def test_a_prompts_blocks_a_cache_reset_and_a_resync_reach_jetstream_in_order(nats_url, worker):
    """A greedy request's full blocks arrive as stored events with exactly its tokens (chained by
    parent hash); a prefix-cache reset shows as a cleared event at once; a reader starting late at
    seq N replays N, N+1, ... with no gap; kv-resync publishes a cleared event plus the blocks the
    engine now holds, which is what applying every event so far gives."""
    instance = worker.instance
    async with Client(nats_url, namespace=worker.namespace, heartbeat_timeout=60) as c:
        nc, names = c.nc, c.names

        async def batches(until) -> list[KvEventBatch]:
            return await kv_batches(nc, names, TINY, instance, until)

        async def control(verb: str) -> ControlDone | ControlFailed:
            reply = await nc.request(names.instance_control(instance, verb), b"", timeout=30)
            return _reply.decode(reply.data)

        start = await batches(lambda b: len(b) >= 1)
        assert start[0].seq == 1 and start[0].resync is not None and start[0].resync.reason == "start"

        prompt = [10 + (i * 7) % 300 for i in range(80)]  # 2 full blocks and half of a third
        done = await c.complete(req(TINY, prompt, stop=StopConditions(max_tokens=40, ignore_eos=True)))
        seq_ids = prompt + done.token_ids  # 120 tokens, 119 of them computed: 3 full blocks
        got = await batches(lambda b: len(stored_blocks(b)) >= 3)
        blocks = stored_blocks(got)
        assert [tokens for _, _, tokens in blocks] == [seq_ids[i * BLOCK : (i + 1) * BLOCK] for i in range(3)]
        assert blocks[0][1] is None and blocks[1][1] == blocks[0][0] and blocks[2][1] == blocks[1][0]
        assert all(b.instance == instance and b.model == TINY and b.dp_rank == 0 for b in got)

        with anyio.fail_after(30):
            while isinstance(answer := await control("reset-prefix-cache"), ControlFailed):
                assert answer.code == ErrorCode.CONFLICT, answer  # blocks still held: try again
                await anyio.sleep(0.2)
        seen = len(got)
        got = await batches(lambda b: any(KvCleared() in x.events and x.resync is None for x in b[seen:]))
        assert kv_blocks(ev for b in got for ev in b.events) == {}

        second = [400 + i for i in range(70)]
        done2 = await c.complete(req(TINY, second, stop=StopConditions(max_tokens=10, ignore_eos=True)))
        got = await batches(lambda b: len(stored_blocks(b)) >= 5)
        live = kv_blocks(ev for b in got for ev in b.events)
        seq2 = second + done2.token_ids
        assert sorted(live.values()) == sorted([seq2[:BLOCK], seq2[BLOCK : 2 * BLOCK]])

        answer = await control("kv-resync")
        assert isinstance(answer, ControlDone), answer
        seen = len(got)
        got = await batches(
            lambda b: any(x.resync is not None and x.resync.reason == "requested" for x in b[seen:])
        )
        snapshot = [x for x in got[seen:] if x.resync is not None and x.resync.reason == "requested"]
        assert snapshot[0].events[0] == KvCleared() and snapshot[-1].resync.part == snapshot[-1].resync.parts
        assert kv_blocks(ev for b in snapshot for ev in b.events) == live

        n = 2
        late = [d async for d in kv_events(nc, names, TINY, instance=instance, start_seq=n, follow=False)]
        assert [d.batch.seq for d in late] == list(range(n, got[-1].seq + 1))
        assert [d.batch for d in late] == got[n - 1 :] and not any(d.missed for d in late)


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _total(samples: dict, name: str, **labels: str) -> float:
    return sum(
        v for (n, ls), v in samples.items() if n == name and all((k, lv) in ls for k, lv in labels.items())
    )


async def test_registry_health_metrics_and_sleep_on_a_real_worker(nats_url, worker):
    instance, namespace = worker.instance, worker.namespace
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=10) as c:
        js, names = c.nc.jetstream(), c.names

        (record,) = await instances(js, names)
        assert (
            record.instance == instance
            and record.model == TINY
            and record.ready
            and record.state == "serving"
        )
        assert record.engine.block_size == 32 and record.engine.max_model_len == 512
        assert record.engine.num_kv_blocks and record.engine.num_kv_blocks > 0 and record.slots == 8
        assert record.engine.engine.startswith("vllm ") and record.pid == worker.proc.pid
        assert record.metrics_url and record.expires_after == pytest.approx(1.5)

        status = subprocess.run(
            [
                sys.executable,
                "-m",
                "jetllm",
                "status",
                "--nats",
                nats_url,
                "--namespace",
                namespace,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert [json.loads(line)["instance"] for line in status.stdout.splitlines()] == [instance]

        (health,) = await ask(c.nc, names, "health", instance=instance)
        assert isinstance(health, HealthReport) and health.healthy and health.canary_ok
        assert health.canary_tokens == 4 and health.canary_latency_ms > 0

        before = await anyio.to_thread.run_sync(_scrape, record.metrics_url)
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(c.complete, req(TINY, [10 + i] * 40, max_tokens=16))
        names_moved = (
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:time_to_first_token_seconds_count",
            "vllm:inter_token_latency_seconds_count",
            "vllm:prefix_cache_queries_total",
            "jetllm_frames_sent_total",
        )
        with anyio.move_on_after(10):  # the engine's stats reach the worker with its next outputs
            while True:
                after = await anyio.to_thread.run_sync(_scrape, record.metrics_url)
                moved = {name: _total(after, name) - _total(before, name) for name in names_moved}
                acked = _total(after, "jetllm_jobs_total", event="acked") - _total(
                    before, "jetllm_jobs_total", event="acked"
                )  # counted once the server confirms the ack, after the final frame
                if all(v > 0 for v in moved.values()) and acked >= 8:
                    break
                await anyio.sleep(0.2)
        assert moved["vllm:prompt_tokens_total"] >= 8 * 40 and moved["vllm:generation_tokens_total"] >= 8 * 16
        assert moved["vllm:time_to_first_token_seconds_count"] >= 8
        assert all(v > 0 for v in moved.values()), moved
        assert acked == 8
        assert any(n == "vllm:kv_cache_usage_perc" for n, _ in after)
        assert _total(after, "jetllm_ready") == 1
        assert _total(after, "jetllm_kv_events_total", event="published") > _total(
            before, "jetllm_kv_events_total", event="published"
        )  # the KV-event relay (on by default)

        traced = req(TINY, [5, 6, 7], max_tokens=4)
        await c.complete(traced, traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        shown = subprocess.run(
            [
                sys.executable,
                "-m",
                "jetllm",
                "trace",
                traced.request_id,
                "--nats",
                nats_url,
                "--namespace",
                namespace,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, shown.stderr
        assert (
            "trace 0af7651916cd43dd8448eb211c80319c" in shown.stdout
            and f"pulled by {instance}" in shown.stdout
        )
        assert "first token" in shown.stdout and "completed: 4 tokens" in shown.stdout

        (reset,) = await ask(c.nc, names, "reset-prefix-cache", instance=instance)
        assert isinstance(reset, ControlDone), reset

        (slept,) = await ask(c.nc, names, "sleep", instance=instance, timeout=60)
        assert (
            isinstance(slept, ControlDone) and slept.state == "sleeping" and "no memory freed" in slept.detail
        )
        with anyio.fail_after(5):
            while (await instances(js, names))[0].state != "sleeping":
                await anyio.sleep(0.1)
        async with anyio.create_task_group() as tg:
            got = {}

            async def run() -> None:
                got["c"] = await c.complete(req(TINY, [7, 8, 9], max_tokens=5))

            tg.start_soon(run)
            await anyio.sleep(4)
            assert "c" not in got  # a sleeping worker pulls nothing
            (woke,) = await ask(c.nc, names, "wake", instance=instance, timeout=60)
            assert isinstance(woke, ControlDone) and woke.state == "serving"
        assert len(got["c"].token_ids) == 5

        for pid in worker.engine_pids():  # the engine dies under a live worker
            os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(60):
            while True:
                (dead,) = await ask(c.nc, names, "health", instance=instance, timeout=30)
                if not dead.engine_alive:
                    break
                await anyio.sleep(0.5)
        assert not dead.healthy and dead.last_error

        worker.signal(signal.SIGKILL)
        with anyio.fail_after(record.expires_after + 3):  # readers drop it after missed heartbeats
            while await instances(js, names):
                await anyio.sleep(0.1)
        kv = await js.key_value(names.registry_bucket)
        with anyio.fail_after(RECORD_TTL + 15):  # and the bucket itself forgets it
            while True:
                try:
                    entry = await kv.get(names.instance_key(instance))
                except Exception:
                    break
                if not entry.value:
                    break
                await anyio.sleep(0.5)
