"""The OpenAI-compatible gateway on the message plane: the real `openai` SDK (sync and async)
against a gateway in front of light-engine workers (processes, so they can be killed)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass

import anyio
import httpx
import nats.errors
import openai
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from jetllm.batches import service as batch_service_module
from jetllm.batches.service import BatchService
from jetllm.gateway import (
    GatewayConfig,
    batches_api,
    chat_api,
    completions_api,
    files_api,
    health_api,
    models_api,
)
from jetllm.gateway.capacity import FleetView
from jetllm.gateway.service import BatchSettings, Gateway
from jetllm.openai.translate import MAX_PROMPTS
from jetllm.producer import Client
from jetllm.producer.fleet import instance_status
from jetllm.schemas import (
    ChatMessage,
    ChatPrompt,
    GenerateRequest,
    InstanceRecord,
    ModelCard,
    SamplingOptions,
    StopConditions,
    TextPrompt,
)
from jetllm.subjects import codec
from jetllm.subjects.connection import connect
from jetllm.subjects.consumers import ensure_consumer
from jetllm.subjects.names import Names
from jetllm.subjects.policy import QueuePolicy
from jetllm.subjects.setup import ensure_registry

from .conftest import FakeWorkerProcess
from .helpers.gateway import GatewayThread

MAX_BODY = 256 << 10
MAX_QUEUE = 2
RETRY_AFTER = 3
USER = [{"role": "user", "content": "hello there"}]
EXTRA = {"ignore_eos": True}  # the light engine's EOS would end some choices early


@dataclass
class Env:
    namespace: str
    worker: FakeWorkerProcess
    gateway: GatewayThread
    nats_url: str

    def sdk(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.base_url, api_key="none", max_retries=0, **kw)

    def async_sdk(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.gateway.base_url, api_key="none", max_retries=0)

    def status(self, instance: str | None = None):
        async def read():
            nc = await connect(self.nats_url)
            try:
                return await instance_status(nc, Names(self.namespace), instance or self.worker.instance)
            finally:
                await nc.close()

        return anyio.run(read)

    def direct(self, req: GenerateRequest):
        """The same job through the producer Client: what the worker itself answers."""

        async def run():
            async with Client(self.nats_url, namespace=self.namespace) as c:
                return await c.complete(req)

        return anyio.run(run)

    def put_record(self, key: str, value: bytes) -> None:
        async def put():
            nc = await connect(self.nats_url)
            try:
                kv = await ensure_registry(nc.jetstream(), Names(self.namespace))
                await kv.put(key, value)
            finally:
                await nc.close()

        anyio.run(put)


@pytest.fixture(scope="module")
def env(nats_url, tmp_path_factory):
    namespace = f"t{uuid.uuid4().hex[:10]}"
    worker = FakeWorkerProcess(
        nats_url, namespace, tmp_path_factory.mktemp("gw") / "fake.log", "--step-delay", "0.005"
    )
    try:
        anyio.run(worker.wait_ready, nats_url)
        config = GatewayConfig(
            nats_url=nats_url,
            namespace=namespace,
            max_queue=MAX_QUEUE,
            retry_after=RETRY_AFTER,
            accept_timeout=10,
            max_body_bytes=MAX_BODY,
            batches=BatchSettings(window=4, batches=1, ack_wait=30, max_file_bytes=1 << 20),
        )
        with GatewayThread(config) as gateway:
            yield Env(namespace, worker, gateway, nats_url)
    finally:
        worker.stop()


def _record(instance: str, model: str, adapters: list[str] | None = None) -> bytes:
    """A registry record as a worker writes it (expires_after 0: alive until replaced)."""
    now = time.time()
    record = InstanceRecord(
        instance=instance,
        role="generate",
        model=model,
        state="serving",
        ready=True,
        adapters=adapters or [],
        started_at=now,
        heartbeat_at=now,
        expires_after=0,
    )
    return codec.encode(record)


def run_batch(env: Env, endpoint: str, bodies: list[dict]) -> list[dict]:
    """The bodies as one batch through the gateway's files and batches endpoints (run by the
    gateway's own runner): its output lines, which must be all of them."""
    sdk = env.sdk()
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": endpoint, "body": body}
        for i, body in enumerate(bodies)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = sdk.files.create(file=("in.jsonl", data), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := sdk.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert batch.status == "completed" and batch.request_counts.completed == len(bodies), batch
    out = [json.loads(x) for x in sdk.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == [f"line-{i}" for i in range(len(bodies))]
    assert all(o["response"]["status_code"] == 200 for o in out)
    return out


def test_a_batch_through_the_gateways_own_files_and_batches_endpoints(env):
    """The gateway serves /v1/files and /v1/batches and runs the batch itself (its runner)."""
    bodies = [
        {"model": "fake", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 3}
        for i in range(6)
    ]
    run_batch(env, "/v1/chat/completions", bodies)


def _comparable(body: dict) -> dict:
    """A response without what differs between two answers to the same request: when and which."""
    body = {k: v for k, v in body.items() if k not in ("id", "created")}
    for choice in body["choices"]:
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            call["id"] = "call"
    return body


@pytest.mark.parametrize(
    "endpoint, bodies",
    [
        (
            "/v1/chat/completions",
            [
                {"messages": USER, "n": 2, "logprobs": True, "top_logprobs": 2, "max_tokens": 4, **EXTRA},
                {
                    "messages": USER,
                    "max_tokens": 3,
                    "tools": [{"type": "function", "function": {"name": "f"}}],
                    "tool_choice": {"type": "function", "function": {"name": "f"}},
                },
                {"messages": USER, "max_tokens": 3, "response_format": {"type": "json_object"}, "seed": 4},
            ],
        ),
        ("/v1/completions", [{"prompt": "hello", "n": 2, "logprobs": 2, "max_tokens": 5, **EXTRA}]),
    ],
)
def test_a_batch_line_answers_what_the_gateway_answers_online(env, endpoint, bodies):
    bodies = [{"model": "fake", **b} for b in bodies]
    with httpx.Client(base_url=env.gateway.root) as http:
        online = [http.post(endpoint, json=b).json() for b in bodies]
    out = run_batch(env, endpoint, bodies)
    prefix = "chatcmpl-" if endpoint == "/v1/chat/completions" else "cmpl-"
    for line, answer in zip(out, online, strict=True):
        response = line["response"]
        assert _comparable(response["body"]) == _comparable(answer)
        assert response["body"]["id"] == prefix + response["request_id"] and answer["id"].startswith(prefix)
    first = online[0]["choices"]  # what the comparison covered: two choices, log-probabilities
    assert len(first) == 2 and (first[1]["logprobs"].get("content") or first[1]["logprobs"]["token_logprobs"])
    if endpoint == "/v1/chat/completions":
        assert online[1]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"


def test_models_lists_what_live_workers_serve(env):
    sdk = env.sdk()
    ids = [m.id for m in sdk.models.list()]
    assert "fake" in ids
    assert sdk.models.retrieve("fake").id == "fake"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")


def test_chat_equals_the_workers_own_answer(env):
    sdk = env.sdk()
    r = sdk.chat.completions.create(
        model="fake", messages=USER, max_tokens=8, temperature=0, extra_body=EXTRA
    )
    assert r.object == "chat.completion" and r.model == "fake"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8
    direct = env.direct(
        GenerateRequest(
            request_id=f"d-{uuid.uuid4().hex}",
            model="fake",
            prompt=ChatPrompt(messages=[ChatMessage(role="user", content="hello there")]),
            sampling=SamplingOptions(temperature=0),
            stop=StopConditions(max_tokens=8, ignore_eos=True),
        )
    )
    assert choice.message.content == direct.text
    assert r.usage.prompt_tokens == direct.usage.prompt_tokens


def test_chat_stream_equals_the_whole_answer_and_ends_with_usage(env):
    sdk = env.sdk()
    whole = sdk.chat.completions.create(
        model="fake", messages=USER, max_completion_tokens=12, extra_body=EXTRA
    )
    chunks = list(
        sdk.chat.completions.create(
            model="fake",
            messages=USER,
            max_completion_tokens=12,
            extra_body=EXTRA,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_and_stop_strings(env):
    sdk = env.sdk()
    r = sdk.chat.completions.create(
        model="fake", messages=USER, n=2, max_tokens=6, temperature=1, extra_body=EXTRA
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content  # the light engine differs per choice
    text = r.choices[0].message.content
    stop = text[text.index(">", 4) + 1 :][:3]  # a piece of a later token
    cut = sdk.chat.completions.create(
        model="fake", messages=USER, n=1, max_tokens=6, temperature=1, stop=stop, extra_body=EXTRA
    )
    assert cut.choices[0].finish_reason == "stop"
    content = cut.choices[0].message.content  # (the light engine does not cut the stop string out)
    assert text.startswith(content) and len(content) < len(text)


def test_completions_text_tokens_and_several_prompts(env):
    sdk = env.sdk()
    r = sdk.completions.create(model="fake", prompt="once upon", max_tokens=5, extra_body=EXTRA)
    assert r.object == "text_completion" and r.usage.completion_tokens == 5
    direct = env.direct(
        GenerateRequest(
            request_id=f"d-{uuid.uuid4().hex}",
            model="fake",
            prompt=TextPrompt(text="once upon"),
            stop=StopConditions(max_tokens=5, ignore_eos=True),
        )
    )
    assert r.choices[0].text == direct.text
    tokens = sdk.completions.create(model="fake", prompt=[5, 6, 7], max_tokens=3, extra_body=EXTRA)
    assert tokens.choices[0].text.startswith("<")  # token prompts answer in text too
    several = sdk.completions.create(
        model="fake", prompt=["once upon", "a time"], n=2, max_tokens=4, extra_body=EXTRA
    )
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.choices[0].text == r.choices[0].text[: len(several.choices[0].text)]
    assert several.usage.completion_tokens == 16


def test_completion_stream_with_usage(env):
    sdk = env.sdk()
    chunks = list(
        sdk.completions.create(
            model="fake",
            prompt="once upon",
            max_tokens=5,
            extra_body=EXTRA,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    whole = sdk.completions.create(
        model="fake", prompt="once upon", max_tokens=5, extra_body={**EXTRA, "return_token_ids": True}
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5
    assert len(whole.choices[0].model_extra["token_ids"]) == 5


def test_bad_requests_are_400s_naming_the_parameter(env):
    sdk = env.sdk()
    cases = [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 7.0}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"extra_body": {"guided_regex": "a+", "guided_choice": ["a"]}}, "guided_choice"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
    ]
    for extra, param in cases:
        kw = {"model": "fake", "messages": USER, **extra}
        with pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(**kw)
        assert info.value.status_code == 400
        assert info.value.body["param"] == param, (extra, info.value.body)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model="fake", prompt=[[]], max_tokens=2)
    assert info.value.body["param"] == "prompt[0]"


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        (
            "/v1/chat/completions",
            json.dumps({"model": "fake", "messages": USER, "seed": 2**70}),
            "seed",
            "<=",
        ),
        (
            "/v1/chat/completions",
            json.dumps({"model": "fake", "messages": USER, "chat_template_kwargs": {"a": 2**70}}),
            "chat_template_kwargs",
            "64-bit",
        ),
        (
            "/v1/chat/completions",
            '{"model":"fake","messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"a":'
            + "[" * 3000
            + "]" * 3000
            + "}}",
            None,
            "nested too deeply",
        ),
        (
            "/v1/chat/completions",
            b'{"model":"fake","messages":[{"role":"user","content":"\xff"}]}',
            None,
            "UTF-8",
        ),
        ("/v1/completions", json.dumps({"model": "fake", "prompt": [5, 2**70]}), "prompt", "64-bit"),
        (
            "/v1/completions",
            json.dumps({"model": "fake", "prompt": ["a"] * (MAX_PROMPTS + 1)}),
            "prompt",
            "256",
        ),
    ],
)
def test_json_a_job_cannot_carry_is_a_400_in_openais_shape(env, path, body, param, says):
    """Big integers, deep nesting, invalid UTF-8, too many prompts: a 400 naming what to change."""
    with httpx.Client(base_url=env.gateway.root, timeout=30) as http:
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert says in error["message"], error


def test_more_prompts_than_max_queue_run_when_nothing_waits(env):
    """An empty queue takes any request, or one of more prompts than --max-queue could never run."""
    several = env.sdk().completions.create(
        model="fake", prompt=["a"] * (MAX_QUEUE + 3), max_tokens=2, extra_body=EXTRA
    )
    assert len(several.choices) == MAX_QUEUE + 3


class _NatsOutOfReach:
    """A JetStream context whose every request times out, as while NATS is unreachable."""

    def __getattr__(self, name: str):
        async def timed_out(*args, **kwargs):
            raise nats.errors.TimeoutError

        return timed_out


def _offline_app() -> Starlette:
    """The gateway's endpoints (files and batches too) on a NATS that never answers."""
    config = GatewayConfig(namespace="offline", max_queue=MAX_QUEUE, retry_after=RETRY_AFTER)
    offline = _NatsOutOfReach()
    service = BatchService(offline, Names("offline"), offline, offline, max_file_bytes=1 << 20)
    app = Starlette(
        routes=[
            *models_api.routes,
            *chat_api.routes,
            *completions_api.routes,
            *health_api.routes,
            *files_api.routes(lambda: service),
            *batches_api.routes(lambda: service),
        ]
    )
    app.state.gateway = Gateway(config, None, FleetView(offline, Names("offline")))
    return app


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", {"model": "fake", "messages": USER}),
        ("POST", "/v1/completions", {"model": "fake", "prompt": "x"}),
        ("POST", "/v1/batches", {"input_file_id": "file-abc", "endpoint": "/v1/chat/completions"}),
        ("GET", "/v1/batches/batch_abc", None),
        ("GET", "/v1/files", None),
    ],
)
def test_nats_out_of_reach_is_a_503_with_retry_after(method, path, body):
    with TestClient(_offline_app()) as http:
        r = http.request(method, path, json=body)
    assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER), r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "no_capacity") and "NATS" in error["message"]


def _hung_up(app: Starlette, path: str, content_type: bytes, sent_part: bytes) -> list[dict]:
    """POST `path` to `app` as a client that sends `sent_part` of its body and hangs up: what the
    app sent back."""
    arriving = iter(
        [{"type": "http.request", "body": sent_part, "more_body": True}, {"type": "http.disconnect"}]
    )
    sent: list[dict] = []

    async def receive():
        return next(arriving)

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", content_type), (b"content-length", b"1000")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    anyio.run(app, scope, receive, send)
    return sent


def test_a_client_gone_while_sending_its_body_is_counted_as_499():
    app = _offline_app()
    _hung_up(app, "/v1/chat/completions", b"application/json", b'{"model": ')
    with TestClient(app) as http:
        metrics = http.get("/metrics").text
    assert 'jetllm_gateway_requests_total{endpoint="chat",status="499"} 1.0' in metrics


def test_a_client_gone_in_the_middle_of_an_upload_is_a_499_not_a_traceback(caplog):
    """As for a generation request: counted as 499, nothing logged as a failure of the gateway."""
    app = _offline_app()
    part = b'--b0\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n{"custom_id": '
    sent = _hung_up(app, "/v1/files", b"multipart/form-data; boundary=b0", part)
    assert sent[0]["status"] == 499
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    with TestClient(app) as http:
        metrics = http.get("/metrics").text
    assert 'jetllm_gateway_requests_total{endpoint="files",status="499"} 1.0' in metrics


@pytest.mark.anyio
async def test_a_batch_that_cannot_be_queued_is_a_503_with_retry_after(nats_url, monkeypatch):
    """Every 503 of the gateway tells the client when to come back, a batch's too."""
    monkeypatch.setattr(batch_service_module, "QUEUE_BACKOFF", 0.01)
    async with Client(nats_url, namespace=f"t{uuid.uuid4().hex[:10]}") as client:
        service = await BatchService.open(client.js, client.names, max_file_bytes=1 << 20)
        line = {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": USER},
        }
        f = await service.upload(json.dumps(line).encode() + b"\n", "in.jsonl", "batch")
        publish, queue = client.js.publish, client.names.batch_queue_all.removesuffix("*")

        async def refused(subject, *args, **kwargs):
            if subject.startswith(queue):
                raise nats.errors.TimeoutError
            return await publish(subject, *args, **kwargs)

        monkeypatch.setattr(client.js, "publish", refused)
        app = Starlette(routes=batches_api.routes(lambda: service))
        config = GatewayConfig(namespace=client.names.namespace, retry_after=RETRY_AFTER)
        app.state.gateway = gw = Gateway(config, client, FleetView(client.js, client.names))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            r = await http.post(
                "/v1/batches", json={"input_file_id": f.id, "endpoint": "/v1/chat/completions"}
            )
    assert r.status_code == 503 and r.headers.get("retry-after") == str(RETRY_AFTER), r.text
    assert "create it again" in r.json()["error"]["message"]
    assert (
        'jetllm_gateway_requests_total{endpoint="batches",status="503"} 1.0' in gw.metrics.render().decode()
    )


def test_unknown_fields_are_ignored_as_openai_does(env):
    r = env.sdk().chat.completions.create(
        model="fake", messages=USER, max_tokens=2, extra_body={"not_a_field": {"x": 1}, "user": "u1"}
    )
    assert r.choices[0].message.content


def test_unknown_model_is_404_and_a_big_body_413(env):
    sdk = env.sdk()
    with pytest.raises(openai.NotFoundError) as info:
        sdk.chat.completions.create(model="nope", messages=USER)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    big = [{"role": "user", "content": "x" * MAX_BODY}]
    with pytest.raises(openai.APIStatusError) as info:
        sdk.chat.completions.create(model="fake", messages=big)
    assert info.value.status_code == 413


def test_no_capacity_is_503_and_a_deep_queue_429_both_with_retry_after(env):
    sdk = env.sdk()
    env.put_record(Names.model_card_key("gone"), codec.encode(ModelCard(model="gone")))
    time.sleep(1.1)  # the gateway rereads the registry at most once a second for a miss
    with pytest.raises(openai.InternalServerError) as info:
        sdk.chat.completions.create(model="gone", messages=USER)
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == str(RETRY_AFTER)

    # a model whose (pretend) worker takes nothing: its queue fills
    env.put_record(Names.instance_key("busy-1"), _record("busy-1", "busy"))

    async def fill() -> None:
        async with Client(env.nats_url, namespace=env.namespace) as c:
            await ensure_consumer(c.js, Names(env.namespace), "generate", "busy", QueuePolicy())
            for _ in range(MAX_QUEUE + 1):
                await c.submit(
                    GenerateRequest(
                        request_id=f"q-{uuid.uuid4().hex}", model="busy", prompt=TextPrompt(text="x")
                    )
                )

    anyio.run(fill)
    time.sleep(1.1)
    with pytest.raises(openai.RateLimitError) as info:
        sdk.chat.completions.create(model="busy", messages=USER)
    assert info.value.status_code == 429 and info.value.response.headers["retry-after"] == str(RETRY_AFTER)
    assert info.value.body["code"] == "queue_full"


def test_an_adapter_is_a_model_whose_jobs_go_to_its_base(env):
    env.put_record(Names.instance_key("adapters-1"), _record("adapters-1", "fake", ["ad1"]))
    time.sleep(1.1)
    models = {m.id: m for m in env.sdk().models.list()}
    assert models["ad1"].model_extra["parent"] == "fake"
    # the real worker of "fake" has no adapter ad1: its typed answer proves where the job went
    with pytest.raises(openai.APIStatusError) as info:
        env.sdk().chat.completions.create(model="ad1", messages=USER, max_tokens=2)
    assert info.value.body["code"] in ("unknown_adapter", "lora_disabled", "adapter_not_loaded")


def _wait_busy(env, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not env.status().in_flight:
        assert time.monotonic() < deadline, "the worker is not running the request"
        time.sleep(0.05)


def _wait_idle(env, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while env.status().in_flight:
        assert time.monotonic() < deadline, "the worker still runs the abandoned request"
        time.sleep(0.1)


def test_a_client_that_hangs_up_cancels_its_request(env):
    body = {"model": "fake", "messages": USER, "max_tokens": 50_000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=env.gateway.root, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: a dropped iterator closes the connection
            for i, _ in enumerate(lines):
                if i > 5:
                    break
            _wait_busy(env)
    _wait_idle(env)
    # the same for a client waiting for a whole answer
    with anyio.from_thread.start_blocking_portal() as portal:
        future = portal.start_task_soon(_post_whole, env.gateway.root, {**body, "stream": False})
        _wait_busy(env)
        future.cancel()  # the client goes away without its answer
    _wait_idle(env)


async def _post_whole(root: str, body: dict) -> None:
    async with httpx.AsyncClient(base_url=root, timeout=300) as http:
        await http.post("/v1/chat/completions", json=body)


def test_health_and_metrics(env):
    with httpx.Client(base_url=env.gateway.root) as http:
        health = http.get("/health")
        assert health.status_code == 200 and "fake" in health.json()["models"]
        metrics = http.get("/metrics").text
    assert 'jetllm_gateway_requests_total{endpoint="chat",status="200"}' in metrics
    assert 'jetllm_gateway_requests_total{endpoint="chat",status="400"}' in metrics
    assert "jetllm_gateway_ttft_seconds_bucket" in metrics


def test_health_is_503_with_no_worker(nats_url):
    config = GatewayConfig(nats_url=nats_url, namespace=f"t{uuid.uuid4().hex[:10]}")
    with GatewayThread(config) as gateway, httpx.Client(base_url=gateway.root) as http:
        r = http.get("/health")
    assert r.status_code == 503 and r.json()["models"] == []


@pytest.mark.anyio
async def test_the_async_sdk_streams_too(env):
    sdk = env.async_sdk()
    stream = await sdk.chat.completions.create(
        model="fake", messages=USER, max_tokens=4, stream=True, extra_body=EXTRA
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    whole = await sdk.chat.completions.create(model="fake", messages=USER, max_tokens=4, extra_body=EXTRA)
    assert text == whole.choices[0].message.content
    await sdk.close()


def test_a_worker_killed_mid_stream_is_invisible_to_the_client(nats_url, start_fake_worker):
    namespace = f"t{uuid.uuid4().hex[:10]}"
    workers = [start_fake_worker(namespace, "--step-delay", "0.02") for _ in range(2)]
    for w in workers:
        anyio.run(w.wait_ready, nats_url)
    config = GatewayConfig(nats_url=nats_url, namespace=namespace)
    with GatewayThread(config) as gateway:
        sdk = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
        kw = {"model": "fake", "messages": USER, "max_tokens": 150, "temperature": 0, "extra_body": EXTRA}
        whole = sdk.chat.completions.create(**kw)
        stream = sdk.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        text, killed = [], False
        for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
            if not killed and len(text) > 20:
                env = Env(namespace, workers[0], gateway, nats_url)
                busy = [w for w in workers if env.status(w.instance).in_flight]
                busy[0].signal(9)
                killed = True
            last = chunk
    assert killed
    assert "".join(text) == whole.choices[0].message.content
    assert last.usage.completion_tokens == 150


def test_the_command_serves_until_terminated(nats_url):
    import signal
    import subprocess
    import sys

    from jetllm.natsserver import free_port

    port = free_port()
    ns = f"t{uuid.uuid4().hex[:10]}"
    cmd = [
        sys.executable,
        "-m",
        "jetllm",
        "gateway",
        "--nats",
        nats_url,
        "--namespace",
        ns,
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the gateway did not listen"
                time.sleep(0.2)
        assert r.status_code == 503 and r.json()["nats"] is True  # connected; no worker in this namespace
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
