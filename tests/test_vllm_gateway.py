"""The gateway in front of real vLLM workers, called by the `openai` SDK. One worker for the file
(a second one starts for the last test, which kills one of them): two engine start-ups in all."""

from __future__ import annotations

import json
import threading
import uuid

import anyio
import httpx
import openai
import pytest
from anyio.from_thread import start_blocking_portal

from jetllm.gateway import GatewayConfig
from jetllm.producer import Client
from jetllm.producer.fleet import instance_status
from jetllm.schemas import (
    ChatMessage,
    ChatPrompt,
    GenerateRequest,
    SamplingOptions,
    StopConditions,
    TextPrompt,
)
from jetllm.subjects.connection import connect
from jetllm.subjects.names import Names

from .conftest import TINY, WorkerProcess, require_vllm
from .helpers.gateway import GatewayThread

pytestmark = pytest.mark.vllm

USER = [{"role": "user", "content": "write a short poem about the sea."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


class Stack:
    def __init__(self, nats_url: str, namespace: str, worker: WorkerProcess, gateway: GatewayThread) -> None:
        self.nats_url, self.namespace, self.worker, self.gateway = nats_url, namespace, worker, gateway
        self.sdk = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)

    def direct(self, req: GenerateRequest):
        async def run():
            async with Client(self.nats_url, namespace=self.namespace) as c:
                return await c.complete(req)

        return anyio.run(run)

    def status(self, instance: str):
        async def read():
            nc = await connect(self.nats_url)
            try:
                return await instance_status(nc, Names(self.namespace), instance)
            finally:
                await nc.close()

        return anyio.run(read)


@pytest.fixture(scope="module")
def stack(nats_url, tiny_model, tmp_path_factory):
    require_vllm()
    namespace = f"t{uuid.uuid4().hex[:10]}"
    logs = tmp_path_factory.mktemp("vgw")
    # compact JSON, as operations.md recommends for structured outputs: the tiny random model would
    # otherwise pick whitespace until max_tokens
    compact = '{"backend": "guidance", "disable_any_whitespace": true}'
    worker = WorkerProcess(
        nats_url, namespace, tiny_model, logs / "worker0.log", "--slots", "8",
        "--engine-arg", f"structured_outputs_config={compact}",
    )  # fmt: skip
    try:
        anyio.run(worker.wait_ready, nats_url, 600)
        with GatewayThread(GatewayConfig(nats_url=nats_url, namespace=namespace)) as gateway:
            yield Stack(nats_url, namespace, worker, gateway)
    finally:
        worker.stop()


def _job(prompt, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"d-{uuid.uuid4().hex}",
        model=TINY,
        prompt=prompt,
        sampling=SamplingOptions(temperature=0),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
    )


def test_greedy_chat_and_completions_equal_the_workers_own_output(stack):
    chat = stack.sdk.chat.completions.create(model=TINY, messages=USER, max_tokens=24, **GREEDY)
    direct = stack.direct(_job(ChatPrompt(messages=[ChatMessage(**m) for m in USER]), 24))
    assert chat.choices[0].message.content == direct.text
    assert chat.usage.prompt_tokens == direct.usage.prompt_tokens and chat.usage.completion_tokens == 24

    cmpl = stack.sdk.completions.create(model=TINY, prompt="The quick brown fox", max_tokens=24, **GREEDY)
    direct = stack.direct(_job(TextPrompt(text="The quick brown fox"), 24))
    assert cmpl.choices[0].text == direct.text

    streamed = stack.sdk.chat.completions.create(
        model=TINY,
        messages=USER,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(streamed)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == chat.choices[0].message.content
    )
    assert chunks[-1].usage.completion_tokens == 24

    lp = stack.sdk.chat.completions.create(
        model=TINY, messages=USER, max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY
    )
    entries = lp.choices[0].logprobs.content
    assert len(entries) == 4 and all(e.token.startswith("token_id:") and e.logprob <= 0 for e in entries)


def test_tools_reach_the_template_and_engine_errors_arrive_as_the_sdks_exceptions(stack):
    # the tools go to the template (the tiny one ignores them); nothing constrains "auto"
    r = stack.sdk.chat.completions.create(model=TINY, messages=USER, tools=[TOOL], max_tokens=8, **GREEDY)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8

    with pytest.raises(openai.BadRequestError) as info:
        stack.sdk.completions.create(model=TINY, prompt="x " * 600, max_tokens=4)
    assert info.value.body["param"] == "prompt"  # the worker's field path, as the request names it
    assert info.value.body["type"] == "invalid_request_error"


@pytest.mark.anyio
async def test_a_streaming_client_that_hangs_up_frees_the_engine_slot(stack):
    """The engine stays frozen from the start until the worker has let the request go, and runs
    2 ms at a time until the client has its first chunk: CI's fast box otherwise made the tiny
    model's 400 tokens before the hang-up reached the worker. Under load one step can still make
    them all (a 10 ms step made 400 tokens with two CPU hogs beside the test); then the request,
    finished before the client hung up, is tried again. Letting it go takes no engine step: the
    abort and the cancelled result are the worker's own."""
    body = {"model": TINY, "messages": USER, "max_tokens": 400, "ignore_eos": True, "stream": True}
    for _ in range(3):
        if await _hang_up_mid_stream(stack, body):
            return
    pytest.fail("each of 3 requests finished before the client hung up: no hang-up was tested")


async def _hang_up_mid_stream(stack: Stack, body: dict) -> bool:
    """False when the request finished before the hang-up (nothing to free)."""
    before = await anyio.to_thread.run_sync(stack.status, stack.worker.instance)
    first_chunk, hang_up = anyio.Event(), anyio.Event()

    async def client() -> None:
        async with httpx.AsyncClient(base_url=stack.gateway.root, timeout=60) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()  # kept: a dropped iterator closes the connection
                async for line in lines:
                    if line.startswith("data: "):
                        first_chunk.set()
                        break
                await hang_up.wait()

    with stack.worker.engine_frozen() as engine:
        async with anyio.create_task_group() as tg:
            tg.start_soon(client)
            await engine.step_until(first_chunk.is_set, step=0.002)
            status = await anyio.to_thread.run_sync(stack.status, stack.worker.instance)
            hang_up.set()
            if status.engine_unfinished == 0:
                assert int(status.extra["completed"]) == int(before.extra["completed"]) + 1, status
                return False
            assert status.engine_unfinished == 1
        with anyio.fail_after(15):
            while True:
                status = await anyio.to_thread.run_sync(stack.status, stack.worker.instance)
                if status.engine_unfinished == 0 and status.in_flight == 0:
                    break
                await anyio.sleep(0.1)
    assert int(status.extra["cancelled"]) == int(before.extra["cancelled"]) + 1
    assert int(status.extra["completed"]) == int(before.extra["completed"])
    return True


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_a_named_tool_choice_comes_back_as_a_tool_call(stack):
    r = stack.sdk.chat.completions.create(
        model=TINY,
        messages=USER,
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48,
        temperature=0,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_response_format_json_schema_validates(stack):
    schema = TOOL["function"]["parameters"]
    r = stack.sdk.chat.completions.create(
        model=TINY,
        messages=USER,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
        max_tokens=48,
        temperature=0,
    )
    doc = json.loads(r.choices[0].message.content)
    assert set(doc) == {"city"} and doc["city"] in ("Paris", "Rome")


async def busy_worker(nc, names: Names, workers) -> WorkerProcess | None:
    """The worker holding a job, asking every worker at once: a worker busy streaming may answer
    late, and asking one after another could outlast a short generation."""
    found: list[WorkerProcess] = []

    async def ask(w: WorkerProcess) -> None:
        with anyio.move_on_after(1):
            s = await instance_status(nc, names, w.instance, timeout=1)
            if s.in_flight or s.engine_unfinished:
                found.append(w)

    async with anyio.create_task_group() as tg:
        for w in workers:
            tg.start_soon(ask, w)
    return found[0] if found else None


async def kill_when_streaming(nc, stack, workers, streaming: threading.Event) -> WorkerProcess | None:
    """SIGKILL the worker that holds the request once `streaming` is set; None when no worker held
    it by then (the generation was already over)."""
    names = Names(stack.namespace)
    running = None
    with anyio.move_on_after(60):
        while running is None or not streaming.is_set():
            if running is None or streaming.is_set():
                running = await busy_worker(nc, names, workers)
                if running is None and streaming.is_set():
                    return None
            await anyio.sleep(0.005)
    if running is not None:
        running.signal(9)
    return running


def test_a_worker_killed_mid_stream_does_not_break_the_stream(stack, tmp_path):
    """Last in the file: it may kill the module's worker. A generation that ends before the watcher
    finds its worker (a fast box) is tried again; the kill itself must happen."""
    second = WorkerProcess(
        stack.nats_url, stack.namespace, stack.worker._params[2], tmp_path / "w1.log", "--slots", "8"
    )
    try:
        anyio.run(second.wait_ready, stack.nats_url, 600)
        kw = {"model": TINY, "messages": USER, "max_tokens": 490, **GREEDY}
        whole = stack.sdk.chat.completions.create(**kw)
        for _attempt in range(3):
            streaming = threading.Event()
            with start_blocking_portal() as portal:
                nc = portal.call(connect, stack.nats_url)
                try:
                    # watching from before the request: the worker that runs it is known by the time
                    # its first chunk reaches the client, and killed then (mid-stream, not after it)
                    watch = portal.start_task_soon(
                        kill_when_streaming, nc, stack, (stack.worker, second), streaming
                    )
                    stream = stack.sdk.chat.completions.create(
                        **kw, stream=True, stream_options={"include_usage": True}
                    )
                    streaming.set()
                    killed = watch.result(timeout=120)
                finally:
                    portal.call(nc.close)
            text = []
            for chunk in stream:
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                last = chunk
            assert "".join(text) == whole.choices[0].message.content
            assert last.usage.completion_tokens == 490
            if killed is not None:
                break
        assert killed is not None, "every generation ended before its worker could be killed"
    finally:
        second.stop()
