"""Bad jobs: a typed error to the producer, a dead letter with the reason, and the worker goes on.

Runs against the light test engine and against a real vLLM worker.
"""

from __future__ import annotations

import uuid

import msgspec
import pytest

from jetllm.producer import Client
from jetllm.schemas import ErrorCode, ErrorFrame, FinalFrame
from jetllm.subjects import codec
from jetllm.subjects.names import Names

from .conftest import TINY, inproc_worker
from .fake_engine import FakeEngine
from .jobs import RawInbox, publish_raw, req, wait_dead_letter

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["fake", pytest.param("vllm", marks=pytest.mark.vllm)])
async def served(request, nats_url, namespace):
    """(client, model) with a worker serving the model: in-process fake, or the shared vLLM worker."""
    if request.param == "fake":
        async with Client(nats_url, namespace=namespace) as c:
            async with inproc_worker(nats_url, FakeEngine(), namespace=namespace):
                yield c, "fake"
    else:
        worker = request.getfixturevalue("shared_vllm")
        async with Client(nats_url, namespace=worker.namespace) as c:
            yield c, TINY


def job_dict(model: str, reply_to: str, **overrides) -> dict:
    body = {
        "v": 1,
        "request_id": f"bad-{uuid.uuid4().hex}",
        "model": model,
        "prompt": {"type": "tokens", "token_ids": [5, 6, 7]},
        "stop": {"max_tokens": 4, "ignore_eos": True},
        "reply_to": reply_to,
    }
    body.update(overrides)
    return body


async def assert_still_serving(c: Client, model: str) -> None:
    done = await c.complete(req(model, max_tokens=3))
    assert len(done.token_ids) == 3


CASES = {
    "wrong schema version": (dict(v=99), ErrorCode.UNSUPPORTED_VERSION, "$.v"),
    "a version that is a list": (dict(v=[1]), ErrorCode.INVALID_REQUEST, "$.v"),
    "a version that is a map": (dict(v={"major": 1}), ErrorCode.INVALID_REQUEST, "$.v"),
    "field of the wrong type": (
        dict(stop={"max_tokens": "four"}),
        ErrorCode.INVALID_REQUEST,
        "$.stop.max_tokens",
    ),
    "negative max_tokens": (dict(stop={"max_tokens": -1}), ErrorCode.INVALID_REQUEST, "$.stop.max_tokens"),
    "unknown field": (dict(max_token=5), ErrorCode.INVALID_REQUEST, "$.max_token"),
    "unknown nested field": (
        dict(sampling={"temprature": 0}),
        ErrorCode.INVALID_REQUEST,
        "$.sampling.temprature",
    ),
    "missing prompt": (dict(prompt=None), ErrorCode.INVALID_REQUEST, "$.prompt"),
    "empty token prompt": (
        dict(prompt={"type": "tokens", "token_ids": []}),
        ErrorCode.INVALID_REQUEST,
        "$.prompt.token_ids",
    ),
}


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
@pytest.mark.parametrize("case", list(CASES))
async def test_invalid_job_gets_a_typed_error_and_a_dead_letter(served, case, encoding):
    c, model = served
    overrides, code, field = CASES[case]
    async with RawInbox(c.nc, encoding=encoding) as inbox:
        body = job_dict(model, inbox.subject, **overrides)
        if body.get("prompt") is None:
            del body["prompt"]
        data = codec.encode(body, encoding)
        await publish_raw(c.nc, c.names, model, data, {"Content-Type": codec.content_type(encoding)})
        frames = await inbox.until_end()
    err = frames[-1]
    assert isinstance(err, ErrorFrame), frames
    assert err.code == code and err.request_id == body["request_id"]
    if field:
        assert err.field == field
    dead = await wait_dead_letter(c.nc, c.names, lambda d: d.request_id == body["request_id"])
    assert dead.code == code and dead.reason == err.message and dead.payload == data
    assert dead.subject == c.names.jobs("generate", model) and dead.deliveries == 1
    await assert_still_serving(c, model)


async def test_malformed_bytes_are_dead_lettered(served):
    c, model = served
    garbage = b"\xc1\xc1 not msgpack " + uuid.uuid4().bytes
    await publish_raw(c.nc, c.names, model, garbage)
    dead = await wait_dead_letter(c.nc, c.names, lambda d: d.payload == garbage)
    assert dead.code == ErrorCode.MALFORMED and "msgpack" in dead.reason
    await assert_still_serving(c, model)


async def test_unknown_content_type_is_malformed(served):
    c, model = served
    body = msgspec.json.encode(job_dict(model, "_INBOX.nobody"))
    await publish_raw(c.nc, c.names, model, body, {"Content-Type": "text/yaml"})
    dead = await wait_dead_letter(c.nc, c.names, lambda d: d.payload == body)
    assert dead.code == ErrorCode.MALFORMED and "text/yaml" in dead.reason
    await assert_still_serving(c, model)


async def test_reply_subject_into_the_jetstream_api_is_refused(served):
    """A job must not make the worker publish into `$JS.API...` (here: delete the jobs stream)."""
    c, model = served
    names = Names(c.names.namespace)
    evil = f"$JS.API.STREAM.DELETE.{names.jobs_stream}"
    body = job_dict(model, evil)
    await publish_raw(c.nc, c.names, model, codec.encode(body))
    dead = await wait_dead_letter(c.nc, c.names, lambda d: d.request_id == body["request_id"])
    assert dead.code == ErrorCode.INVALID_REQUEST and "reply_to" in dead.reason
    info = await c.nc.jetstream().stream_info(names.jobs_stream)
    assert info.config.name == names.jobs_stream
    await assert_still_serving(c, model)


async def test_a_good_job_between_bad_ones_is_answered(served):
    c, model = served
    await publish_raw(c.nc, c.names, model, b"\x00garbage")
    async with RawInbox(c.nc) as inbox:
        good = msgspec.structs.replace(req(model, max_tokens=2), reply_to=inbox.subject)
        await publish_raw(c.nc, c.names, model, codec.encode(good))
        frames = await inbox.until_end()
    assert isinstance(frames[-1], FinalFrame)


async def test_a_job_with_invalid_utf8_gets_a_typed_error_and_the_worker_serves_on(served):
    """One mutated byte inside a JSON string used to end the worker (msgspec raises
    UnicodeDecodeError, not a DecodeError); the redelivered job then ended the next one."""
    c, model = served
    async with RawInbox(c.nc, encoding="json") as inbox:
        body = job_dict(model, inbox.subject, prompt={"type": "text", "text": "caf\u00e9"})
        data = codec.encode(body, "json").replace("é".encode(), b"\x96")
        await publish_raw(c.nc, c.names, model, data, {"Content-Type": "application/json"})
        frames = await inbox.until_end()
    err = frames[-1]
    assert isinstance(err, ErrorFrame) and err.code == ErrorCode.MALFORMED, frames
    assert "UTF-8" in err.message and err.request_id == body["request_id"]
    dead = await wait_dead_letter(c.nc, c.names, lambda d: d.request_id == body["request_id"])
    assert dead.code == ErrorCode.MALFORMED and dead.payload == data
    await assert_still_serving(c, model)
