"""Prompt embeddings against real vLLM workers: rows of the model's own embedding table must
generate what the token ids do; every malformed tensor is a typed error and the worker goes on."""

from __future__ import annotations

import concurrent.futures
import hashlib
import signal
import uuid

import anyio
import msgspec
import nats.js.errors
import numpy as np
import pytest

from jetllm.errors import RequestFailed
from jetllm.producer import Client, embeds_prompt
from jetllm.producer.embeds import embeds_store, upload
from jetllm.schemas import (
    AcceptedFrame,
    EmbedsPrompt,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    GenerateRequest,
    OutputOptions,
    SamplingOptions,
    StopConditions,
    TokensFrame,
    TokensPrompt,
)
from jetllm.schemas.requestlog import Claim, Steps
from jetllm.subjects import codec
from jetllm.subjects.connection import connect
from jetllm.subjects.names import Names

from .conftest import TINY, WorkerProcess, require_vllm

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

HIDDEN = 256
LIMIT = 300_000  # the worker's --max-embeds-bytes: 292 float32 rows, 585 float16 rows
PROMPT = [1, 5, 6, 7, 8, 300, 12, 44]


@pytest.fixture(scope="module")
def table(tiny_model) -> np.ndarray:
    from safetensors.numpy import load_file

    return load_file(str(tiny_model / "model.safetensors"))["model.embed_tokens.weight"]


@pytest.fixture(scope="module")
def embeds_worker(nats_url, tiny_model, tmp_path_factory):
    require_vllm()
    ns = f"emb{uuid.uuid4().hex[:8]}"
    w = WorkerProcess(
        nats_url,
        ns,
        tiny_model,
        tmp_path_factory.mktemp("emb") / "worker.log",
        "--enable-prompt-embeds",
        "--max-embeds-bytes",
        str(LIMIT),
    )
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(anyio.run, w.wait_ready, nats_url).result()
        yield w
    finally:
        w.stop()


def request(prompt, *, max_tokens=24, ignore_eos=True) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"e-{uuid.uuid4().hex}",
        model=TINY,
        prompt=prompt,
        sampling=SamplingOptions(temperature=0),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=ignore_eos),
    )


async def rejected(c: Client, prompt, **kw) -> RequestFailed:
    return await rejected_request(c, request(prompt, **kw))


async def rejected_request(c: Client, job: GenerateRequest) -> RequestFailed:
    with pytest.raises(RequestFailed) as info:
        await c.complete(job)
    return info.value


async def test_embeddings_generate_what_their_tokens_do_and_bad_tensors_are_typed_errors(
    nats_url, embeds_worker, table
):
    ns = embeds_worker.namespace
    async with Client(nats_url, namespace=ns, heartbeat_timeout=30) as c:
        want = await c.complete(request(TokensPrompt(PROMPT)))
        rows = table[PROMPT]

        got = await c.complete(request(embeds_prompt(rows)))
        assert got.token_ids == want.token_ids
        assert got.usage.prompt_tokens == len(PROMPT)
        assert got.text is None  # numbers in, numbers out (unless output.text asks)
        texted = await c.complete(
            msgspec.structs.replace(request(embeds_prompt(rows)), output=OutputOptions(text=True))
        )
        assert texted.token_ids == want.token_ids and texted.text
        for half in (rows.astype(np.float16), (rows.view(np.uint32) >> 16).astype(np.uint16)):
            dtype = "float16" if half.dtype == np.float16 else "bfloat16"
            got = await c.complete(request(embeds_prompt(half, dtype=dtype)))
            assert got.token_ids[:8] == want.token_ids[:8], dtype  # rounding may change later tokens
            assert got.usage.prompt_tokens == len(PROMPT)

        good = embeds_prompt(rows)
        cases = [
            (embeds_prompt(np.zeros((4, 128), np.float32)), "$.prompt.shape", "hidden size 128"),
            (
                EmbedsPrompt(dtype="float64", shape=[8, HIDDEN], data=rows.astype(np.float64).tobytes()),  # type: ignore[arg-type]
                "$.prompt.dtype",
                "float64",
            ),
            (EmbedsPrompt(dtype="float32", shape=[1, 8, HIDDEN], data=good.data), "$.prompt.shape", "2-D"),
            (EmbedsPrompt(dtype="float32", shape=[9, HIDDEN], data=good.data), "$.prompt.data", "needs 9216"),
            (embeds_prompt(np.ones((300, HIDDEN), np.float32)), "$.prompt.shape", f"at most {LIMIT} bytes"),
            (embeds_prompt(np.full((2, HIDDEN), np.nan, np.float32)), "$.prompt.data", "NaN"),
            (
                EmbedsPrompt(dtype="float32", shape=[8, HIDDEN], object="nope", sha256="0" * 64),
                "$.prompt.object",
                "no object",
            ),
        ]
        for prompt, field, words in cases:
            err = await rejected(c, prompt)
            assert (err.code, err.field) == (ErrorCode.INVALID_REQUEST, field), (field, err)
            assert words in err.remote_message, err.remote_message
        err = await rejected(c, embeds_prompt(np.ones((500, HIDDEN), np.float16)), max_tokens=20)
        assert err.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED and "512" in err.remote_message

        assert (await c.complete(request(good))).token_ids == want.token_ids  # the worker went on serving

        # A producer speaking JSON sends the bytes as base64.
        async with Client(nats_url, namespace=ns, heartbeat_timeout=30, encoding="json") as cj:
            assert (await cj.complete(request(good))).token_ids == want.token_ids


async def test_big_embeddings_go_through_the_object_store_checked_against_their_digest(
    nats_url, embeds_worker, table
):
    ns = embeds_worker.namespace
    ids = [(7 * i + 3) % 512 for i in range(280)]  # 286,720 bytes: under the worker's limit
    async with Client(nats_url, namespace=ns, heartbeat_timeout=30, embeds_inline_max=64 * 1024) as c:
        want = await c.complete(request(TokensPrompt(ids), max_tokens=16))
        got = await c.complete(request(embeds_prompt(table[ids]), max_tokens=16))
        assert got.token_ids == want.token_ids and got.usage.prompt_tokens == len(ids)
        store = await c.js.object_store(Names(ns).embeds_store)
        assert [o async for o in _names(store)] == []  # generate() removed its object when it ended

        # Objects uploaded by hand: a wrong digest, and one bigger than the worker takes.
        prompt = embeds_prompt(table[PROMPT])
        ref = await upload(store, "hand/1", prompt)
        err = await rejected(
            c,
            EmbedsPrompt(
                dtype="float32",
                shape=ref.shape,
                object=ref.object,
                sha256=hashlib.sha256(b"other").hexdigest(),
            ),
        )
        assert (err.code, err.field) == (ErrorCode.INVALID_REQUEST, "$.prompt.sha256")
        big = await upload(store, "hand/2", embeds_prompt(np.ones((400, HIDDEN), np.float32)))
        err = await rejected(c, big, max_tokens=8)
        assert err.field == "$.prompt.shape" and f"at most {LIMIT} bytes" in err.remote_message
        assert (await c.complete(request(ref))).token_ids == (
            await c.complete(request(TokensPrompt(PROMPT)))
        ).token_ids


async def _names(store):
    try:
        for info in await store.list():
            if not info.deleted:
                yield info.name
    except nats.js.errors.NotFoundError:
        return


DELIVERED = 8
"""Tokens the client holds before the first worker's engine is frozen: few, so that a client slower
than the tiny model (a loaded box) still sees them while the request runs (CI saw 20 come after all
400 were made, three tries in a row)."""


async def test_a_drained_worker_hands_an_embeddings_request_on_and_the_output_is_unchanged(
    nats_url, embeds_worker, start_worker, table
):
    """The second worker continues in vLLM's mixed mode (embedding rows, then the delivered ids).
    The first worker's engine is frozen once the client has a few tokens, and the worker's status
    must confirm it still runs the request (a client slower than the tiny model, on a loaded CI
    box, saw its 20th token after all 400 were made); a try that finished on the first worker
    anyway (its result was being stored when the drain came) runs again."""
    from jetllm.producer.fleet import instance_status

    ns = embeds_worker.namespace
    ids = [20, 3, 77, 5]
    async with Client(nats_url, namespace=ns, heartbeat_timeout=30) as c:
        want = await c.complete(request(TokensPrompt(ids), max_tokens=400))
        first = None
        try:
            for _ in range(5):
                embeds_worker.signal(signal.SIGSTOP)  # only the new worker takes the job
                if first is None:
                    first = start_worker(ns, "--enable-prompt-embeds", "--grace-period", "0")
                    await first.wait_ready(nats_url)
                await anyio.sleep(5)  # the frozen worker's outstanding pulls expire on the server
                frames: list = []
                req = request(embeds_prompt(table[ids]), max_tokens=400)
                async with anyio.create_task_group() as tg:

                    async def follow(req=req, frames=frames) -> None:
                        async for frame in c.generate(req):
                            frames.append(frame)

                    tg.start_soon(follow)
                    with anyio.fail_after(120):
                        while sum(len(f.token_ids) for f in frames if isinstance(f, TokensFrame)) < DELIVERED:
                            await anyio.sleep(0.01)
                    with first.engine_frozen():
                        status = await instance_status(c.nc, c.names, first.instance)
                        if req.request_id not in status.request_ids:
                            continue  # it finished before the freeze: nothing to hand on
                        drained, first = first, None
                        embeds_worker.signal(signal.SIGCONT)
                        drained.signal(signal.SIGTERM)  # grace 0: it hands the request on at once
                        with anyio.fail_after(30):
                            while not (
                                "handing back" in drained.log_tail(100)
                                or any(isinstance(f, FinalFrame) for f in frames)
                                or drained.proc.poll() is not None
                            ):
                                await anyio.sleep(0.05)
                if not (isinstance(frames[-1], FinalFrame) and frames[-1].attempt == 1):
                    break
            else:
                raise AssertionError("every try finished on the first worker")
        finally:
            embeds_worker.signal(signal.SIGCONT)
    assert not any(isinstance(f, ErrorFrame) for f in frames), frames[-1]
    final = frames[-1]
    assert isinstance(final, FinalFrame) and final.attempt >= 2  # finished on the other worker
    moved = [f for f in frames if isinstance(f, AcceptedFrame) and f.attempt >= 2]
    assert (
        moved and moved[0].resumed_tokens >= DELIVERED
    )  # it continued after delivered tokens, not from scratch
    assert [t for f in frames if isinstance(f, TokensFrame) for t in f.token_ids] == want.token_ids
    assert final.usage.prompt_tokens == len(ids)


async def test_a_forged_log_with_a_token_outside_the_vocabulary_fails_that_request_not_the_worker(
    nats_url, embeds_worker, table
):
    """vLLM does not check the token positions of a mixed embeddings prompt: before the check, a
    log record claiming token 600 was delivered crashed the engine when the job continued from it
    (the fuzz test found it)."""
    ns = embeds_worker.namespace
    names = Names(ns)
    ids = [20, 3, 77, 5]
    async with Client(nats_url, namespace=ns, heartbeat_timeout=30) as c:
        job = request(embeds_prompt(table[ids]), max_tokens=8)
        frame = TokensFrame(seq=2, attempt=1, token_ids=[600])
        for record in (Claim(attempt=1, worker="ghost", at=0.0), Steps(attempt=1, frames=[frame])):
            await c.js.publish(names.request_log(job.request_id), codec.encode(record))
        with anyio.fail_after(60):  # a crashed engine leaves the job waiting for another worker
            failed = await rejected_request(c, job)
        assert failed.code == ErrorCode.NOT_MIGRATABLE and "token 600" in str(failed)
        want = await c.complete(request(TokensPrompt(ids)))
        assert (await c.complete(request(embeds_prompt(table[ids])))).token_ids == want.token_ids
    assert embeds_worker.proc.poll() is None


async def test_store_is_created_with_a_ttl(nats_url, namespace):
    nc = await connect(nats_url)
    try:
        js = nc.jetstream()
        store = await embeds_store(js, Names(namespace), ttl=60)
        status = await store.status()
        assert status.stream_info.config.max_age == 60
    finally:
        await nc.close()
