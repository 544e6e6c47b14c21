"""Embeddings prompts without vLLM: the wire form, the checks a worker makes, the producer helper."""

from __future__ import annotations

import json
import uuid

import msgspec
import numpy as np
import pytest

from jetllm.errors import RequestFailed, RequestRejected
from jetllm.producer import embeds_prompt
from jetllm.schemas import EmbedsPrompt, ErrorCode, GenerateRequest, StopConditions, TokensPrompt
from jetllm.subjects import codec
from jetllm.subjects.codec import HEADER_MARGIN
from jetllm.workers.embeds import HARD_CAP, check_header, default_max_bytes, to_array
from jetllm.workers.engine import EngineFacts
from jetllm.workers.jobs import dead_letter_record, decode_request

from .conftest import inproc_worker

FACTS = EngineFacts(model="m", max_model_len=64, hidden_size=8, prompt_embeds=True)


def job(prompt: EmbedsPrompt) -> GenerateRequest:
    return GenerateRequest(request_id="r1", model="m", prompt=prompt)


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
def test_the_tensor_travels_as_raw_bytes_in_msgpack_and_base64_in_json(encoding):
    arr = np.arange(16, dtype=np.float32).reshape(2, 8)
    req = job(embeds_prompt(arr))
    data = codec.encode(req, encoding)
    if encoding == "json":
        assert json.loads(data)["prompt"]["type"] == "embeds"
        assert isinstance(json.loads(data)["prompt"]["data"], str)  # base64
    else:
        assert arr.tobytes() in data  # not pickled, not copied into a list of floats
    back, _ = decode_request(data, {codec.CONTENT_TYPE: codec.content_type(encoding)})
    assert isinstance(back.prompt, EmbedsPrompt) and back.prompt.data == arr.tobytes()
    assert back.prompt.shape == [2, 8] and back.prompt.dtype == "float32"


def test_an_unknown_dtype_fails_decoding_with_its_field():
    req = job(EmbedsPrompt(dtype="int8", shape=[1, 8], data=b"\0" * 8))  # type: ignore[arg-type]
    with pytest.raises(RequestRejected) as info:
        decode_request(codec.encode(req), None)
    assert info.value.field == "$.prompt.dtype"


def test_the_helper_converts_arrays_and_refuses_what_no_worker_takes():
    arr = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    assert embeds_prompt(arr.astype(">f4")).data == arr.tobytes()  # big-endian input is swapped
    assert embeds_prompt(arr[:, ::2]).shape == [3, 4]  # strided views are made contiguous
    half = embeds_prompt(arr.astype(np.float16))
    assert half.dtype == "float16" and len(half.data) == 3 * 8 * 2
    bits = (arr.view(np.uint32) >> 16).astype(np.uint16)
    bf = embeds_prompt(bits, dtype="bfloat16")
    assert bf.dtype == "bfloat16" and bf.data == bits.tobytes()
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        embeds_prompt(arr.astype(np.float64))
    with pytest.raises(ValueError, match="2-D"):
        embeds_prompt(arr[None])


def test_checks_name_the_field_and_the_limit():
    limit = default_max_bytes(FACTS)
    assert limit == 64 * 8 * 4
    good = embeds_prompt(np.ones((4, 8), np.float32))
    assert check_header(good, FACTS, limit) == 128
    bad = {
        "$.prompt": (good, msgspec.structs.replace(FACTS, prompt_embeds=False)),
        "$.prompt.data": (msgspec.structs.replace(good, data=good.data[:-4]), FACTS),
        "$.prompt.shape": (msgspec.structs.replace(good, shape=[4, 16], data=good.data * 2), FACTS),
        "$.prompt.sha256": (EmbedsPrompt(dtype="float32", shape=[4, 8], object="x"), FACTS),
    }
    for field, (prompt, facts) in bad.items():
        with pytest.raises(RequestRejected) as info:
            check_header(prompt, facts, limit)
        assert info.value.field == field and info.value.code == ErrorCode.INVALID_REQUEST
    both = msgspec.structs.replace(good, object="x", sha256="0" * 64)
    with pytest.raises(RequestRejected, match="exactly one"):
        check_header(both, FACTS, limit)
    with pytest.raises(RequestRejected, match="at most 100 bytes"):
        check_header(good, FACTS, 100)
    with pytest.raises(RequestRejected) as info:
        check_header(embeds_prompt(np.ones((64, 8), np.float32)), FACTS, limit)
    assert info.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
    huge = msgspec.structs.replace(FACTS, max_model_len=1 << 20, hidden_size=1 << 12)
    assert default_max_bytes(huge) == HARD_CAP


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_nan_and_infinity_are_refused_in_every_dtype(dtype):
    arr = np.ones((2, 8), np.float32)
    ok = (
        embeds_prompt((arr.view(np.uint32) >> 16).astype(np.uint16), dtype=dtype)
        if dtype == "bfloat16"
        else embeds_prompt(arr.astype(dtype))
    )
    assert to_array(ok.data, dtype, ok.shape).shape == (2, 8)
    for value in (np.nan, np.inf, -np.inf):
        arr[1, 3] = value
        p = (
            embeds_prompt((arr.view(np.uint32) >> 16).astype(np.uint16), dtype=dtype)
            if dtype == "bfloat16"
            else embeds_prompt(arr.astype(dtype))
        )
        with pytest.raises(RequestRejected, match="NaN or infinite"):
            to_array(p.data, dtype, p.shape)


def test_a_dead_letter_too_big_for_a_message_keeps_its_reason_without_the_payload():
    def record(max_payload, headers=None):
        return dead_letter_record(
            subject="s",
            payload=b"x" * 100_000,
            headers=headers,
            code=ErrorCode.INVALID_REQUEST,
            reason="bad",
            worker="w",
            deliveries=1,
            request_id="r",
            max_payload=max_payload,
        )

    whole = record(None)
    fits = len(codec.encode(whole)) + HEADER_MARGIN
    assert record(fits).payload == whole.payload and record(fits).reason == "bad"
    dropped = record(fits - 1)
    assert dropped.payload == b""
    assert dropped.reason == "bad [payload of 100000 bytes not kept: too big for a dead letter]"
    assert len(codec.encode(dropped)) + HEADER_MARGIN <= fits - 1
    big_headers = record(50_000, headers={"h": "y" * 60_000})
    assert big_headers.payload == b"" and big_headers.headers == {}
    assert (
        big_headers.reason == "bad [payload of 100000 bytes and headers not kept: too big for a dead letter]"
    )


@pytest.mark.anyio
async def test_a_worker_without_embeddings_says_how_to_enable_them_and_goes_on(nats_url, client, fake_engine):
    async with inproc_worker(nats_url, fake_engine, namespace=client.names.namespace):
        req = GenerateRequest(
            request_id=f"r-{uuid.uuid4().hex}",
            model="fake",
            prompt=embeds_prompt(np.ones((2, 8), np.float32)),
            stop=StopConditions(max_tokens=3),
        )
        with pytest.raises(RequestFailed) as info:
            await client.complete(req)
        assert (
            info.value.code == ErrorCode.INVALID_REQUEST
            and "--enable-prompt-embeds" in info.value.remote_message
        )
        ok = msgspec.structs.replace(req, request_id=f"r-{uuid.uuid4().hex}", prompt=TokensPrompt([1, 2]))
        assert len((await client.complete(ok)).token_ids) == 3


@pytest.mark.anyio
async def test_objects_whose_metadata_lies_are_refused_at_once(nats_url, client):
    """Anyone can write an object's metadata: unreadable metadata, chunks that are not there or that
    belong to a bigger object get a typed error now, not a wait (forever, for the missing chunks) nor
    retries until JetStream gives up on the job."""
    import base64
    import hashlib

    import anyio

    from jetllm.producer.embeds import embeds_store

    from .fake_engine import FakeEngine

    engine = FakeEngine()
    engine.facts.hidden_size, engine.facts.prompt_embeds = 8, True
    names, js = client.names, client.js
    good = np.full((2, 8), 0.5, np.float32).tobytes()
    store = await embeds_store(js, names, ttl=600)
    await store.put("good", good)
    await store.put("big", b"\0" * 4096)

    async def meta(name: str) -> dict:
        subject = f"$O.{names.embeds_store}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
        return json.loads((await js.get_last_msg(f"OBJ_{names.embeds_store}", subject)).data)

    async def forge(name: str, body: bytes) -> None:
        subject = f"$O.{names.embeds_store}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
        await js.publish(subject, body, headers={"Nats-Rollup": "sub"})

    good_meta, big_meta = await meta("good"), await meta("big")
    await forge("garbage", b"{not json")
    await forge("no-chunks", json.dumps({**good_meta, "name": "no-chunks", "nuid": "NoSuchChunks"}).encode())
    await forge("no-nuid", json.dumps({**good_meta, "name": "no-nuid", "nuid": None}).encode())
    await forge(
        "big-chunks", json.dumps({**good_meta, "name": "big-chunks", "nuid": big_meta["nuid"]}).encode()
    )
    sha = hashlib.sha256(good).hexdigest()
    async with inproc_worker(nats_url, engine, namespace=names.namespace):
        for name in ("garbage", "no-chunks", "no-nuid", "big-chunks"):
            req = GenerateRequest(
                request_id=f"r-{uuid.uuid4().hex}",
                model="fake",
                stop=StopConditions(max_tokens=2),
                prompt=EmbedsPrompt(dtype="float32", shape=[2, 8], object=name, sha256=sha),
            )
            with anyio.fail_after(15), pytest.raises(RequestFailed) as info:
                await client.complete(req)
            assert info.value.code == ErrorCode.INVALID_REQUEST and info.value.field == "$.prompt.object", (
                name,
                info,
            )
        req = GenerateRequest(
            request_id=f"r-{uuid.uuid4().hex}",
            model="fake",
            stop=StopConditions(max_tokens=2),
            prompt=EmbedsPrompt(dtype="float32", shape=[2, 8], object="good", sha256=sha),
        )
        assert len((await client.complete(req)).token_ids) == 2
