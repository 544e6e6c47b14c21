"""The fleet control plane against a real vLLM worker process: registry record and its expiry,
`jetllm status`, health with a canary, Prometheus metrics under load, prefix-cache reset, sleep
and wake, and health once the engine is dead."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jetllm.producer import Client
from jetllm.producer.fleet import ask
from jetllm.producer.registry import instances
from jetllm.schemas import ControlDone, HealthReport
from jetllm.subjects.setup import RECORD_TTL

from .conftest import TINY
from .jobs import req

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]


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


async def test_registry_health_metrics_and_sleep_on_a_real_worker(
    nats_url, namespace, start_worker, tmp_path
):
    worker = start_worker(namespace, "--slots", "8", "--registry-interval", "0.5", "--health-interval", "600")
    instance = await worker.wait_ready(nats_url)
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
        after = await anyio.to_thread.run_sync(_scrape, record.metrics_url)
        moved = {
            name: _total(after, name) - _total(before, name)
            for name in (
                "vllm:prompt_tokens_total",
                "vllm:generation_tokens_total",
                "vllm:time_to_first_token_seconds_count",
                "vllm:inter_token_latency_seconds_count",
                "vllm:prefix_cache_queries_total",
                "jetllm_frames_sent_total",
            )
        }
        assert moved["vllm:prompt_tokens_total"] >= 8 * 40 and moved["vllm:generation_tokens_total"] >= 8 * 16
        assert moved["vllm:time_to_first_token_seconds_count"] >= 8
        assert all(v > 0 for v in moved.values()), moved
        assert (
            _total(after, "jetllm_jobs_total", event="acked")
            - _total(before, "jetllm_jobs_total", event="acked")
        ) == 8
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
