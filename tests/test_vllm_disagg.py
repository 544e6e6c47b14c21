"""Prefill/decode disaggregation on real vLLM: a prefill worker and a decode worker (two engines)
against the aggregated shared worker, whose output is the reference."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import uuid
from collections.abc import Iterator

import anyio
import nats.js.errors
import pytest

from jetllm.producer import Client
from jetllm.producer.fleet import instance_status
from jetllm.schemas import (
    AcceptedFrame,
    ChatMessage,
    ChatPrompt,
    GenerateRequest,
    SamplingOptions,
    StopConditions,
    TextPrompt,
    TokensFrame,
    TokensPrompt,
)

from .conftest import TINY, WorkerProcess, require_vllm, stop_all
from .jobs import prefill_note as note_of

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

THRESHOLD = 64
READY = 900.0
"""Seconds an engine may take to start: two engines and more start here on a shared CPU."""
LONG = [5 + (i * 7) % 400 for i in range(150)]


def fresh_long() -> list[int]:
    """A 150-token prompt no engine has cached yet (each engine keeps a prefix cache)."""
    head = uuid.uuid4().int
    return [4 + (head >> (8 * i)) % 250 for i in range(8)] + LONG[8:]


TEXT = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)


def request(prompt, rid: str | None = None, tokens: int = 24) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid or f"r-{uuid.uuid4().hex}",
        model=TINY,
        prompt=prompt,
        sampling=SamplingOptions(temperature=0),
        stop=StopConditions(max_tokens=tokens, ignore_eos=True),
    )


@pytest.fixture(scope="module")
def disagg(nats_url, tiny_model, tmp_path_factory) -> Iterator[dict[str, WorkerProcess]]:
    """A prefill worker (with test faults: tests/helpers/faulty_prefill.py) and a decode worker."""
    require_vllm()
    namespace = f"pd{uuid.uuid4().hex[:8]}"
    logs = tmp_path_factory.mktemp("disagg")
    for role in ("prefill", "decode"):
        (logs / f"{role}-tmp").mkdir()
    prefill = WorkerProcess(
        nats_url,
        namespace,
        tiny_model,
        logs / "prefill.log",
        "--role",
        "prefill",
        "--kv-store-bytes",
        str(64 << 20),
        module="tests.helpers.faulty_prefill",
        env={"TMPDIR": str(logs / "prefill-tmp")},
    )
    decode = WorkerProcess(
        nats_url,
        namespace,
        tiny_model,
        logs / "decode.log",
        "--role",
        "decode",
        "--disagg-threshold",
        str(THRESHOLD),
        "--prefill-timeout",
        "600",
        env={"TMPDIR": str(logs / "decode-tmp")},
    )
    workers = {"prefill": prefill, "decode": decode}
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            for w in workers.values():
                pool.submit(anyio.run, w.wait_ready, nats_url, READY).result()
        yield workers
    finally:
        stop_all(list(workers.values()))


def leftover_blocks(workers: dict[str, WorkerProcess]) -> list[str]:
    """Files in the prefill and decode workers' block directories (the CLI makes them in TMPDIR)."""
    dirs = [
        d
        for role in ("prefill", "decode")
        for d in (workers[role].log_path.parent / f"{role}-tmp").glob("jetllm-kvblocks-*")
    ]
    assert len(dirs) == 2, dirs
    return [f.name for d in dirs for f in d.iterdir()]


async def run(url: str, namespace: str, req: GenerateRequest):
    async with Client(url, namespace=namespace, heartbeat_timeout=30) as c:
        return await c.complete(req)


async def prefill_note(url: str, namespace: str, rid: str) -> str | None:
    async with Client(url, namespace=namespace) as c:
        return await note_of(c, rid)


async def completed(url: str, namespace: str, w: WorkerProcess) -> int:
    async with Client(url, namespace=namespace) as c:
        return int((await instance_status(c.nc, c.names, w.instance)).extra["completed"])


async def test_disaggregated_output_equals_aggregated_for_token_text_and_chat_prompts(
    nats_url, disagg, shared_vllm
):
    ns = disagg["decode"].namespace
    prompts = [
        TokensPrompt(token_ids=LONG),
        TextPrompt(text=TEXT),
        ChatPrompt(messages=[ChatMessage(role="user", content=TEXT)]),
    ]
    before = await completed(nats_url, ns, disagg["prefill"])
    for prompt in prompts:
        want = await run(nats_url, shared_vllm.namespace, request(prompt))
        req = request(prompt)
        got = await run(nats_url, ns, req)
        assert got.token_ids == want.token_ids, type(prompt).__name__
        assert got.text == want.text
        # the decode engine took the prompt's full blocks from the prefill worker's
        assert got.usage.cached_tokens >= 128 and got.usage.cached_tokens % 32 == 0, got.usage
        note = await prefill_note(nats_url, ns, req.request_id)
        assert note and note.startswith(f"remote on {disagg['prefill'].instance}"), note
    with anyio.fail_after(10):  # the prefill worker counts a job once its ack is confirmed, after its answer
        while await completed(nats_url, ns, disagg["prefill"]) != before + 3:
            await anyio.sleep(0.1)
    async with Client(nats_url, namespace=ns) as c:
        s = await instance_status(c.nc, c.names, disagg["decode"].instance)
        assert int(s.extra["prefill_remote"]) >= 3
        with pytest.raises(nats.js.errors.NotFoundError):  # went straight to the decode worker
            await c.js.stream_info(c.names.kv_blocks_stream)
    with anyio.fail_after(5):  # every block file is removed once published, or loaded
        while leftover_blocks(disagg):
            await anyio.sleep(0.1)


async def test_a_prompt_in_the_decode_engines_prefix_cache_is_prefilled_there(nats_url, disagg, shared_vllm):
    """The first time the prompt's blocks come from the prefill worker, and the decode engine keeps
    them in its prefix cache; the second time it holds most of the prompt, so it stays here."""
    ns = disagg["decode"].namespace
    prompt = TokensPrompt(token_ids=fresh_long())
    want = await run(nats_url, shared_vllm.namespace, request(prompt))
    notes = []
    for _ in range(2):
        req = request(prompt)
        got = await run(nats_url, ns, req)
        assert got.token_ids == want.token_ids and got.usage.cached_tokens >= 128, got.usage
        notes.append(await prefill_note(nats_url, ns, req.request_id))
    assert notes[0] and notes[0].startswith(f"remote on {disagg['prefill'].instance}"), notes
    assert notes[1] and notes[1].startswith("local: cached ("), notes
    assert notes[1].endswith(f" of {len(prompt.token_ids)} prompt tokens in this engine's prefix cache)")
    async with Client(nats_url, namespace=ns) as c:
        s = await instance_status(c.nc, c.names, disagg["decode"].instance)
    assert s.extra["prefill_local_cached"] == "1", s.extra


async def test_a_short_prompt_never_leaves_the_decode_worker(nats_url, disagg):
    ns = disagg["decode"].namespace
    before = await completed(nats_url, ns, disagg["prefill"])
    req = request(TokensPrompt(token_ids=LONG[: THRESHOLD - 1]))
    got = await run(nats_url, ns, req)
    assert len(got.token_ids) == 24
    assert await prefill_note(nats_url, ns, req.request_id) == "local: short"
    assert await completed(nats_url, ns, disagg["prefill"]) == before


async def test_corrupt_blocks_are_detected_and_the_prompt_is_computed_locally(nats_url, disagg, shared_vllm):
    ns = disagg["decode"].namespace
    prompt = TokensPrompt(token_ids=fresh_long())
    want = await run(nats_url, shared_vllm.namespace, request(prompt))
    req = request(prompt, rid=f"corrupt-kv-{uuid.uuid4().hex}")
    got = await run(nats_url, ns, req)
    assert got.token_ids == want.token_ids
    assert got.usage.cached_tokens == 0
    note = await prefill_note(nats_url, ns, req.request_id)
    assert note and note.startswith("local:") and "block 2 of 4 fails its checksum" in note, note


async def test_cancel_during_a_remote_prefill_frees_the_prefill_workers_slot(nats_url, disagg):
    ns = disagg["decode"].namespace
    prefill, decode = disagg["prefill"], disagg["decode"]
    async with Client(nats_url, namespace=ns, heartbeat_timeout=30) as c:

        async def local_decisions() -> int:
            extra = (await instance_status(c.nc, c.names, decode.instance)).extra
            return sum(int(v) for k, v in extra.items() if k.startswith("prefill_local"))

        async def follow(req: GenerateRequest, tokens: list[TokensFrame]) -> None:
            async for frame in c.generate(req):
                if isinstance(frame, TokensFrame):
                    tokens.append(frame)

        # The decode worker reads the prefill queue's state once a second; right after a prefill
        # worker finished a job it may see none waiting and prefill here. That try proves
        # nothing about cancelling a remote prefill, so another request is sent.
        remote = False
        for _ in range(3):
            req = request(TokensPrompt(token_ids=fresh_long()), rid=f"slow-prefill-{uuid.uuid4().hex}")
            before = await local_decisions()
            tokens: list[TokensFrame] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(follow, req, tokens)
                with anyio.fail_after(30):
                    while True:
                        ids = (await instance_status(c.nc, c.names, prefill.instance)).request_ids
                        if any(i.startswith(req.request_id) for i in ids):
                            remote = True
                            break
                        if await local_decisions() > before:
                            break
                        await anyio.sleep(0.1)
                await c.cancel(req.request_id)
                if remote:
                    with anyio.fail_after(30):  # a request leaves the running list before its slot is free
                        while (
                            s := await instance_status(c.nc, c.names, prefill.instance)
                        ).request_ids or s.in_flight:
                            await anyio.sleep(0.1)
                    assert s.in_flight == 0 and not tokens
                tg.cancel_scope.cancel()
            if remote:
                break
        assert remote, "the decode worker prefilled all three prompts itself"


# The tests below run last, in this order: they kill the module's decode worker (a second one,
# on vLLM's example connector, takes its place), then its prefill worker (one on the example
# connector takes its place). The example connector stores every prompt's KV in a shared directory
# and loads it when the same prompt comes again. Each behaviour costs no engine of its own.


@pytest.fixture(scope="module")
def example_fleet(disagg, tmp_path_factory) -> Iterator[dict]:
    """Starts workers on vLLM's ExampleConnector (`start(role)`), stopped with the module."""
    shared = tmp_path_factory.mktemp("example-connector-kv")
    flags = ["--kv-connector", "ExampleConnector"]
    flags += ["--kv-connector-config", json.dumps({"shared_storage_path": str(shared)})]
    started: list[WorkerProcess] = []
    like = disagg["decode"]

    def start(role: str, *args: str) -> WorkerProcess:
        w = WorkerProcess(
            like._params[0],
            like.namespace,
            like._params[2],
            like.log_path.with_name(f"example-{role}.log"),
            "--role",
            role,
            *args,
            *flags,
        )
        started.append(w)
        return w

    try:
        yield {"start": start}
    finally:
        stop_all(started)


async def test_a_decode_worker_killed_after_the_handoff_migrates_with_the_same_tokens(
    nats_url, disagg, shared_vllm, example_fleet
):
    """SIGKILL, not a drain: a drain hands requests back on purpose, while a crash after the blocks
    came and tokens were streamed is what migration must survive. The request goes on on a second
    decode worker, started after the kill so that the first one surely took it.

    The kill lands while the decode engine is frozen mid-request, which the worker's status
    confirms first: a client slower than the tiny model (a loaded CI box) may see its first
    tokens only once all of them were made, and then nothing is killed; that try is run again."""
    ns = disagg["decode"].namespace
    prefill, decode = disagg["prefill"], disagg["decode"]

    async def kill_mid_request() -> dict | None:
        """One try: the request's tokens, who sent them and the second decode worker, or None
        when the first decode worker had finished it before it could be killed."""
        prompt = TokensPrompt(token_ids=fresh_long())
        want = await run(nats_url, shared_vllm.namespace, request(prompt, tokens=300))
        req = request(prompt, tokens=300)
        before = await completed(nats_url, ns, prefill)
        got: dict = {"tokens": [], "workers": [], "want": want, "req": req}
        killed = anyio.Event()
        async with Client(nats_url, namespace=ns, heartbeat_timeout=30) as c:
            async with anyio.create_task_group() as tg:

                async def follow() -> None:
                    async for frame in c.generate(req):
                        if isinstance(frame, AcceptedFrame):
                            got["workers"].append(frame.worker)
                        if isinstance(frame, TokensFrame):
                            got["tokens"].extend(frame.token_ids)
                            if "streamed" not in got:
                                got["streamed"] = len(got["tokens"])
                                with decode.engine_frozen():
                                    status = await instance_status(c.nc, c.names, decode.instance)
                                    if req.request_id in status.request_ids:
                                        decode.signal(signal.SIGKILL)
                                        killed.set()
                    if not killed.is_set():
                        tg.cancel_scope.cancel()

                tg.start_soon(follow)
                with anyio.fail_after(300):
                    await killed.wait()
                with anyio.fail_after(30):  # the prompt was prefilled remotely before the first token
                    while await completed(nats_url, ns, prefill) != before + 1:
                        await anyio.sleep(0.2)
                got["second"] = example_fleet["start"](
                    "decode", "--disagg-threshold", str(THRESHOLD), "--prefill-timeout", "600"
                )
                await got["second"].wait_ready(nats_url, READY)
        return got if killed.is_set() else None

    for _ in range(3):
        if (got := await kill_mid_request()) is not None:
            break
    assert got is not None, "the decode worker finished every try before it could be killed"
    assert 1 <= got["streamed"] < 300
    assert got["tokens"] == got["want"].token_ids
    assert got["workers"][0] == decode.instance and got["workers"][-1] == got["second"].instance, got[
        "workers"
    ]
    assert await prefill_note(nats_url, ns, got["req"].request_id) == "local: continuation"
    example_fleet["decode"] = got["second"]


async def test_a_decode_worker_on_another_connector_computes_the_prompt_locally(
    nats_url, disagg, shared_vllm, example_fleet
):
    """The second decode worker loads with vLLM's ExampleConnector, and the jetllm prefill worker
    answers: another connector moved the blocks, so the prompt is computed locally (a counted
    reason) and the output is the same."""
    ns = disagg["decode"].namespace
    decode = example_fleet["decode"]
    prompt = TokensPrompt(token_ids=fresh_long())
    want = await run(nats_url, shared_vllm.namespace, request(prompt))
    req = request(prompt)
    got = await run(nats_url, ns, req)
    assert got.token_ids == want.token_ids
    note = await prefill_note(nats_url, ns, req.request_id)
    assert note and note.startswith("local:") and "jetllm KV connector" in note, note
    assert got.usage.cached_tokens == 0
    async with Client(nats_url, namespace=ns) as c:
        s = await instance_status(c.nc, c.names, decode.instance)
    assert s.extra["prefill_local_fallback_connector"] == "1", s.extra


async def test_a_prefill_worker_killed_mid_prefill_costs_a_local_prefill_not_the_request(
    nats_url, disagg, shared_vllm
):
    ns = disagg["decode"].namespace
    prefill = disagg["prefill"]
    prompt = TokensPrompt(token_ids=fresh_long())
    want = await run(nats_url, shared_vllm.namespace, request(prompt))
    req = request(prompt, rid=f"slow-prefill-{uuid.uuid4().hex}")
    async with Client(nats_url, namespace=ns, heartbeat_timeout=30) as c:
        async with anyio.create_task_group() as tg:
            result = {}

            async def one() -> None:
                result["got"] = await c.complete(req)

            tg.start_soon(one)
            with anyio.fail_after(30):
                while not (await instance_status(c.nc, c.names, prefill.instance)).request_ids:
                    await anyio.sleep(0.1)
            prefill.signal(signal.SIGKILL)
    got = result["got"]
    assert got.token_ids == want.token_ids and got.usage.cached_tokens == 0
    note = await prefill_note(nats_url, ns, req.request_id)
    assert note and note.startswith("local:"), note


async def test_vllms_own_connector_moves_the_blocks_with_the_same_handoff_messages(
    nats_url, disagg, shared_vllm, example_fleet
):
    """A prefill worker on the ExampleConnector replaces the jetllm one: the same
    PrefillRequest/Prefilled pass, the connectors move the bytes, and the output is the same."""
    ns = disagg["decode"].namespace
    disagg["prefill"].stop()  # killed above; stopped in any case
    prefill = example_fleet["start"]("prefill")
    await prefill.wait_ready(nats_url, READY)
    prompt = TokensPrompt(token_ids=fresh_long())
    want = await run(nats_url, shared_vllm.namespace, request(prompt))
    req = request(prompt)
    got = await run(nats_url, ns, req)
    assert got.token_ids == want.token_ids
    note = await prefill_note(nats_url, ns, req.request_id)
    assert note and note.startswith(f"remote on {prefill.instance}"), note
    assert "moved by ExampleConnector" in note, note
    # the decode engine took the prompt's full blocks through the connector
    assert got.usage.cached_tokens >= 128 and got.usage.cached_tokens % 32 == 0, got.usage
