"""Frames come from outside the gateway: whoever may publish to a job's inbox can send anything.
A frame naming a choice the request lacks fails that request with an OpenAI error (a 500, or the
error event of a stream that has begun) naming the choice, as a producer fails it
(tests/test_forged_frames.py), and the gateway goes on serving. Here the test plays the worker."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass

import anyio
import httpx
import pytest

from jetllm.gateway import GatewayConfig
from jetllm.schemas import AcceptedFrame, Choice, FinalFrame, InstanceRecord, TokensFrame, Usage
from jetllm.subjects import codec
from jetllm.subjects.connection import connect
from jetllm.subjects.names import Names
from jetllm.subjects.setup import ensure_registry

from .helpers.gateway import GatewayThread

pytestmark = pytest.mark.anyio

MODEL = "forged"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hello"}]


@dataclass
class Played:
    nats_url: str
    names: Names
    gateway: GatewayThread


@pytest.fixture(scope="module")
def played(nats_url):
    """A gateway whose model has one (pretend) serving worker, which the test plays."""
    names = Names(f"t{uuid.uuid4().hex[:10]}")

    async def register() -> None:
        nc = await connect(nats_url)
        try:
            now = time.time()
            record = InstanceRecord(
                instance="forger-1",
                role="generate",
                model=MODEL,
                state="serving",
                ready=True,
                started_at=now,
                heartbeat_at=now,
                expires_after=0,
            )
            kv = await ensure_registry(nc.jetstream(), names)
            await kv.put(Names.instance_key("forger-1"), codec.encode(record))
        finally:
            await nc.close()

    anyio.run(register)  # before the gateway starts: its first read of the registry finds it
    config = GatewayConfig(nats_url=nats_url, namespace=names.namespace, accept_timeout=10)
    with GatewayThread(config) as gateway:
        yield Played(nats_url, names, gateway)


def accepted(rid: str) -> AcceptedFrame:
    return AcceptedFrame(seq=0, attempt=1, request_id=rid, worker="forger-1", model=MODEL)


def tokens(seq: int, index: int = 0, text: str = "a") -> TokensFrame:
    return TokensFrame(seq=seq, token_ids=[5], index=index, text=text)


def final(rid: str, seq: int, *indexes: int) -> FinalFrame:
    choices = [Choice(index=i, finish_reason="length", completion_tokens=1) for i in indexes]
    return FinalFrame(
        seq=seq, request_id=rid, choices=choices, usage=Usage(prompt_tokens=3, completion_tokens=len(indexes))
    )


async def exchange(played: Played, path: str, body: dict, frames) -> httpx.Response:
    """POST `body` to the gateway; the job's frames are `frames(request_id)`, sent to its inbox by hand."""
    nc = await connect(played.nats_url)
    try:
        jobs = await nc.subscribe(played.names.jobs("generate", MODEL))
        await nc.flush()

        async def worker() -> None:
            job = codec.request_decoder.decode((await jobs.next_msg(timeout=10)).data)
            for frame in frames(job.request_id):
                await nc.publish(job.reply_to, codec.encode(frame))

        async with anyio.create_task_group() as tg:
            tg.start_soon(worker)
            with anyio.fail_after(20):
                async with httpx.AsyncClient(base_url=played.gateway.root, timeout=20) as http:
                    return await http.post(path, json={"model": MODEL, **body})
    finally:
        await nc.close()


def events(response: httpx.Response) -> list:
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _no_traceback(caplog) -> None:
    failures = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert failures == [], [r.getMessage() for r in failures]


WHOLE = [
    pytest.param(
        CHAT,
        {"messages": USER},
        lambda rid: [accepted(rid), tokens(1), tokens(2, index=3), final(rid, 3, 0)],
        "names choice 3",
        id="chat: a choice the request lacks",
    ),
    pytest.param(
        CHAT,
        {"messages": USER},
        lambda rid: [accepted(rid), tokens(1, index=-1), final(rid, 2, 0)],
        "names choice -1",
        id="chat: a negative choice",
    ),
    pytest.param(
        COMPLETIONS,
        {"prompt": "x"},
        lambda rid: [accepted(rid), tokens(1), final(rid, 2, 0, 1)],
        "names choice 1",
        id="completions: a final frame with an extra choice",
    ),
    pytest.param(
        COMPLETIONS,
        {"prompt": ["x", "y"]},
        lambda rid: [accepted(rid), tokens(1, index=1), final(rid, 2, 0)],
        "names choice 1",
        id="completions: another prompt's choice",
    ),
    pytest.param(
        CHAT,
        {"messages": USER, "n": 2, "temperature": 1.0},
        lambda rid: [accepted(rid), tokens(1), tokens(2, index=1), final(rid, 3, 0)],
        "lacks choice 1",
        id="chat: a final frame missing a choice",
    ),
    pytest.param(
        CHAT,
        {"messages": USER, "n": 2, "temperature": 1.0},
        lambda rid: [accepted(rid), tokens(1), final(rid, 2, 0, 1, 0)],
        "names choice 0 more than once",
        id="chat: a final frame naming a choice twice",
    ),
    pytest.param(
        CHAT,
        {"messages": USER},
        lambda rid: [accepted(rid), tokens(1), final(rid, 2)],
        "lacks choice 0",
        id="chat: a final frame without choices",
    ),
]


@pytest.mark.parametrize("path, body, frames, says", WHOLE)
async def test_a_forged_choice_fails_a_whole_answer_with_a_500_naming_it(
    played, caplog, path, body, frames, says
):
    r = await exchange(played, path, body, frames)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal") and says in error["message"], error
    _no_traceback(caplog)


STREAMED = [
    pytest.param(
        CHAT,
        {"messages": USER},
        lambda rid: [accepted(rid), tokens(1), tokens(2, index=4), final(rid, 3, 0)],
        "names choice 4",
        id="chat: a choice the request lacks",
    ),
    pytest.param(
        COMPLETIONS,
        {"prompt": "x"},
        lambda rid: [accepted(rid), tokens(1), final(rid, 2, 0, 1)],
        "names choice 1",
        id="completions: a final frame with an extra choice",
    ),
    pytest.param(
        CHAT,
        {"messages": USER, "n": 2, "temperature": 1.0},
        lambda rid: [accepted(rid), tokens(1), tokens(2, index=1), final(rid, 3, 1)],
        "lacks choice 0",
        id="chat: a final frame missing a choice",
    ),
]


@pytest.mark.parametrize("path, body, frames, says", STREAMED)
async def test_a_forged_choice_mid_stream_is_the_streams_error_event(
    played, caplog, path, body, frames, says
):
    r = await exchange(played, path, {**body, "stream": True}, frames)
    assert r.status_code == 200, r.text
    *chunks, error, done = events(r)
    assert done == "[DONE]" and chunks and all("choices" in c for c in chunks)
    assert error["error"]["code"] == "internal" and says in error["error"]["message"], error
    _no_traceback(caplog)


async def test_the_gateway_goes_on_serving_after_forged_frames(played):
    forged = await exchange(
        played, CHAT, {"messages": USER}, lambda rid: [accepted(rid), tokens(1, index=9), final(rid, 2, 0)]
    )
    assert forged.status_code == 500 and "names choice 9" in forged.json()["error"]["message"]
    fine = await exchange(
        played, CHAT, {"messages": USER}, lambda rid: [accepted(rid), tokens(1, text="hi"), final(rid, 2, 0)]
    )
    assert fine.status_code == 200, fine.text
    choice = fine.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("hi", "length")
