"""Data parallel: a leader worker whose second rank runs in a `--headless` process (what a second
host would run). Both ranks serve; load and metrics are reported per rank; the headless process
pulls no jobs, answers no control subjects, and exits cleanly on SIGTERM."""

from __future__ import annotations

import signal
import socket
import urllib.request

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jetllm.producer import Client
from jetllm.producer.fleet import worker_statuses
from jetllm.producer.registry import instances
from jetllm.schemas import LoadReport
from jetllm.subjects import codec

from .conftest import TINY
from .jobs import req

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_leader_and_a_headless_rank_serve_together(nats_url, namespace, start_worker):
    port = str(_free_port())
    dp = [
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        port,
    ]
    leader = start_worker(namespace, *dp, "--slots", "8", "--registry-interval", "0.5")
    headless = start_worker(namespace, *dp, "--headless", "--data-parallel-start-rank", "1")
    instance = await leader.wait_ready(nats_url, timeout=400)
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=10) as c:
        (record,) = await instances(c.nc.jetstream(), c.names)
        assert record.instance == instance and record.dp_ranks == [0, 1] and record.engine.dp_size == 2
        assert [s.instance for s in await worker_statuses(c.nc, c.names)] == [instance]  # headless: silent

        reports: dict[int, LoadReport] = {}
        sub = await c.nc.subscribe(c.names.load(TINY, instance))
        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(c.complete, req(TINY, [20 + i, 21, 22], max_tokens=24))
        with anyio.fail_after(10):
            while len(reports) < 2:
                msg = await sub.next_msg(timeout=5)
                report = codec.Decoder(LoadReport).decode(msg.data)
                reports[report.dp_rank] = report
        await sub.unsubscribe()
        assert all(r.instance == instance and r.num_kv_blocks for r in reports.values())

        text = urllib.request.urlopen(record.metrics_url, timeout=10).read().decode()
        generated = {
            s.labels.get("engine"): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "vllm:generation_tokens_total"
        }
        assert generated.get("0", 0) > 0 and generated.get("1", 0) > 0, generated  # both ranks worked

    headless.signal(signal.SIGTERM)
    assert headless.wait(timeout=120) == 0, headless.log_tail()
