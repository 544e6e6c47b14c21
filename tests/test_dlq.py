"""`jetllm dlq`: dead letters are listed, shown, and replayed once the cause is fixed."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import pytest

from jetllm.errors import RequestFailed
from jetllm.schemas import ErrorCode
from jetllm.subjects import Client

from .conftest import inproc_worker
from .fake_engine import FakeEngine
from .jobs import req, wait_dead_letter

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
            replayed = await anyio.to_thread.run_sync(lambda: jetllm("dlq", "replay", *common, str(row["seq"])))
            assert replayed.returncode == 0, replayed.stderr
            result = await c.wait_result("too-long-1", timeout=20)
        assert result.final is not None and len(result.token_ids[0]) == 5
        after = await anyio.to_thread.run_sync(lambda: jetllm("dlq", "list", *common, "--json"))
        assert after.stdout.strip() == ""  # replayed records leave the stream
        assert ErrorCode.CONTEXT_LENGTH_EXCEEDED.value in shown.stdout
