"""A durable batch on real vLLM workers survives its runner and a worker being SIGKILLed mid-batch,
its lines travelling in shards.

Two engine start-ups for the file: the worker that dies and the one that finishes the batch (it
also gives the reference outputs).
"""

from __future__ import annotations

import json
import os
import signal
import uuid

import anyio
import httpx
import openai
import pytest
from starlette.applications import Starlette

from jetllm.batches.service import BatchService
from jetllm.gateway import batches_api, files_api
from jetllm.openai.endpoints import CHAT, prepare
from jetllm.producer import Client
from jetllm.subjects.names import SHARD_QUEUE
from jetllm.workers.shards import shard_room

from .conftest import TINY
from .test_batches import jsonl, start_runner

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

LINES = 200
ACK_WAIT = 3.0


def line(i: int) -> dict:
    body = {
        "model": TINY,
        "messages": [{"role": "user", "content": f"Say something about the number {i}."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    return {"custom_id": f"line-{i}", "method": "POST", "url": CHAT, "body": body}


async def test_a_batch_finishes_once_per_line_after_its_runner_and_a_worker_die(
    nats_url, start_worker, tmp_path
):
    namespace = f"vb{uuid.uuid4().hex[:8]}"
    workers = [start_worker(namespace, "--slots", "16"), start_worker(namespace, "--slots", "16")]
    for w in workers:
        await w.wait_ready(nats_url, timeout=600)
    runners = []
    flags = ("--batch-window", "16", "--batch-ack-wait", str(ACK_WAIT))
    try:
        async with Client(nats_url, namespace=namespace, heartbeat_timeout=30) as client:
            service = await BatchService.open(client.js, client.names, ack_wait=ACK_WAIT)
            app = Starlette(routes=files_api.routes(lambda: service) + batches_api.routes(lambda: service))
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw"
            ) as http:
                sdk = openai.AsyncOpenAI(
                    base_url="http://gw/v1", api_key="none", http_client=http, max_retries=0
                )
                lines = [line(i) for i in range(LINES)]
                f = await sdk.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
                batch = await sdk.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
                runners.append(start_runner(nats_url, namespace, tmp_path / "runner0.log", *flags))
                with anyio.fail_after(600):
                    while (await sdk.batches.retrieve(batch.id)).request_counts.completed < 40:
                        await anyio.sleep(0.2)
                os.killpg(runners[0].pid, signal.SIGKILL)
                workers[0].signal(signal.SIGKILL)
                runners[0].wait()
                killed_at = (await sdk.batches.retrieve(batch.id)).request_counts.completed
                runners.append(start_runner(nats_url, namespace, tmp_path / "runner1.log", *flags))
                with anyio.fail_after(900):
                    while (done := await sdk.batches.retrieve(batch.id)).status not in (
                        "completed",
                        "failed",
                        "expired",
                    ):
                        await anyio.sleep(0.5)
                log1 = (tmp_path / "runner1.log").read_text(errors="replace")
                assert done.status == "completed", (done.errors, log1[-3000:])
                assert killed_at < LINES
                counts = done.request_counts
                assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0)
                assert done.error_file_id is None
                content = (await sdk.files.content(done.output_file_id)).content
                out = [json.loads(x) for x in content.splitlines()]
                assert [x["custom_id"] for x in out] == [f"line-{i}" for i in range(LINES)]
                assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in out)
                # workers of 16 slots take shards (of 4 lines): the lines travelled in them
                shards = await client.js.consumer_info(
                    client.names.jobs_stream, client.names.consumer(SHARD_QUEUE, TINY)
                )
                assert shards.delivered.consumer_seq >= LINES // shard_room(16) // 2, shards.delivered

                # the same requests, run again on the surviving worker: the same greedy text
                limiter = anyio.Semaphore(32)
                reference: dict[int, str] = {}

                async def again(i: int) -> None:
                    async with limiter:
                        req = prepare(CHAT, lines[i]["body"], f"ref-{namespace}-{i}").job.request
                        reference[i] = (await client.complete(req)).text or ""

                async with anyio.create_task_group() as tg:
                    for i in range(LINES):
                        tg.start_soon(again, i)
                texts = [x["response"]["body"]["choices"][0]["message"]["content"] for x in out]
                differing = [i for i in range(LINES) if texts[i] != reference[i]]
                assert not differing, [(i, texts[i], reference[i]) for i in differing[:5]]
    finally:
        for p in runners:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
