"""A prefill worker and a decode worker on the light engine (its stand-in connector writes and
loads block files as jetllm's does in vLLM): the handoff's messages, both ways of moving the
blocks, and what is left behind. tests/test_vllm_disagg.py runs the same against real vLLM."""

from __future__ import annotations

import uuid

import anyio
import nats.js.errors
import pytest

from jetllm.producer import Client
from jetllm.producer.fleet import instance_status
from jetllm.workers.config import DisaggSettings
from jetllm.workers.roles.decode.role import DecodeRole
from jetllm.workers.roles.prefill import PrefillRole

from .conftest import inproc_worker
from .fake_engine import FakeEngine
from .jobs import prefill_note, req

pytestmark = pytest.mark.anyio

PROMPT = [3 + i % 90 for i in range(100)]  # 6 full blocks of 16 tokens; the last token computed


@pytest.mark.parametrize("stored", [False, True])
async def test_a_long_prompt_is_prefilled_by_the_prefill_worker_and_its_blocks_loaded(
    nats_url, namespace, tmp_path, stored
):
    dirs = {role: tmp_path / role for role in ("prefill", "decode")}
    engines = {role: FakeEngine() for role in dirs}
    for role, d in dirs.items():
        d.mkdir()
        engines[role].block_dir = d
    settings = {
        role: DisaggSettings(block_dir=str(d), threshold=32, stored=stored) for role, d in dirs.items()
    }
    async with (
        inproc_worker(
            nats_url,
            engines["prefill"],
            role=PrefillRole,
            namespace=namespace,
            instance="pre-1",
            disagg=settings["prefill"],
        ),
        inproc_worker(
            nats_url,
            engines["decode"],
            role=DecodeRole,
            namespace=namespace,
            instance="dec-1",
            disagg=settings["decode"],
        ),
        Client(nats_url, namespace=namespace) as c,
    ):
        r = req("fake", PROMPT, request_id=f"r-{uuid.uuid4().hex}")
        with anyio.fail_after(30):
            got = await c.complete(r)
        note = await prefill_note(c, r.request_id)
        assert note and note.startswith("remote on pre-1"), note
        assert engines["decode"].loaded == {r.request_id: 96}  # the decode engine took 6 blocks
        assert got.token_ids == await computed_alone(r)
        try:
            info = await c.js.stream_info(c.names.kv_blocks_stream)
            kept = info.state.messages
        except nats.js.errors.NotFoundError:
            kept = None
        assert kept == (0 if stored else None)  # stored: purged once loaded; direct: never stored
        s = await instance_status(c.nc, c.names, "dec-1")
        assert s.extra["prefill_remote"] == "1"
    assert [p.name for d in dirs.values() for p in d.iterdir()] == []


async def computed_alone(r) -> list[int]:
    """The tokens one engine gives the request with no handoff."""
    steps = FakeEngine().generate(r, list(r.prompt.token_ids), r.stop.max_tokens)
    return [t async for step in steps for choice in step.choices for t in choice.token_ids]
