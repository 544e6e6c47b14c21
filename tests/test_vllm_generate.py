"""Generation through jetllm against a real vLLM worker, compared with vLLM's AsyncLLM called directly."""

from __future__ import annotations

import functools
import math
import uuid

import anyio
import pytest

from jetllm.errors import RequestFailed
from jetllm.producer import Client
from jetllm.schemas import (
    AcceptedFrame,
    ChatMessage,
    ChatPrompt,
    ErrorCode,
    FinalFrame,
    GenerateRequest,
    OutputOptions,
    PulledFrame,
    SamplingOptions,
    StopConditions,
    TextPrompt,
    TokensFrame,
    TokensPrompt,
)

from .conftest import TINY, running_then_frozen
from .jobs import RawInbox, consumer_counts, publish_raw

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

# Greedy continuations of these prompts end in EOS (id 2) after 46 and 24 tokens (found by search).
ENDS_IN_EOS = [[171, 99, 166], [224, 311, 277, 213]]
PROMPTS = [[1, 5, 6, 7, 8], [300, 12, 44, 9, 150, 151, 152, 7], [11] * 20, *ENDS_IN_EOS]


@pytest.fixture
async def c(shared_vllm, nats_url):
    async with Client(nats_url, namespace=shared_vllm.namespace, heartbeat_timeout=30) as client:
        yield client


def request(prompt, *, max_tokens=None, **kw) -> GenerateRequest:
    if isinstance(prompt, list):
        prompt = TokensPrompt(prompt)
    stop = kw.pop("stop", None) or StopConditions(max_tokens=max_tokens)
    return GenerateRequest(
        request_id=kw.pop("request_id", f"v-{uuid.uuid4().hex}"),
        model=TINY,
        prompt=prompt,
        sampling=kw.pop("sampling", SamplingOptions(temperature=0)),
        stop=stop,
        **kw,
    )


async def ref(direct, prompt: dict, **params) -> dict:
    result = await anyio.to_thread.run_sync(lambda: direct.run(prompt, **params))
    assert "error" not in result, result
    return result


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_greedy_token_mode_equals_asyncllm_called_directly(c, direct, prompt):
    expected = await ref(direct, {"token_ids": prompt}, temperature=0, max_tokens=64)
    got = await c.complete(request(prompt, max_tokens=64))
    assert got.token_ids == expected["token_ids"]
    assert got.finish_reason == expected["finish_reason"]
    assert got.usage.prompt_tokens == len(prompt)
    assert got.usage.completion_tokens == len(expected["token_ids"])


async def test_eos_ends_generation_unless_ignore_eos(c, direct):
    prompt = ENDS_IN_EOS[1]
    plain = await c.complete(request(prompt, max_tokens=64))
    forced = await c.complete(request(prompt, stop=StopConditions(max_tokens=64, ignore_eos=True)))
    expected = await ref(direct, {"token_ids": prompt}, temperature=0, max_tokens=64, ignore_eos=True)
    assert plain.finish_reason == "stop" and plain.token_ids[-1] == 2 and len(plain.token_ids) < 64
    assert forced.finish_reason == "length" and len(forced.token_ids) == 64
    assert forced.token_ids == expected["token_ids"]


async def test_chat_mode_applies_the_chat_template_and_text_deltas_concatenate(c, direct):
    messages = [
        {"role": "system", "content": "you are a helpful assistant."},
        {"role": "user", "content": "write a short poem about the sea."},
    ]
    expected = await ref(direct, {"chat": messages}, temperature=0, max_tokens=40)
    req = request(
        ChatPrompt([ChatMessage(role=m["role"], content=m["content"]) for m in messages]), max_tokens=40
    )
    deltas, tokens, final = [], [], None
    async for frame in c.generate(req):
        if isinstance(frame, TokensFrame):
            deltas.append(frame.text)
            tokens.extend(frame.token_ids)
        elif isinstance(frame, FinalFrame):
            final = frame
    # the template was applied: same rendered prompt length as vLLM's own chat rendering
    assert final.usage.prompt_tokens == len(expected["prompt_token_ids"]) > 20
    assert tokens == expected["token_ids"]
    assert all(d is not None for d in deltas)
    assert "".join(deltas) == expected["text"]


async def test_text_prompt_is_tokenized_like_vllm(c, direct):
    expected = await ref(
        direct, {"text": "Once upon a time there was a tiny model"}, temperature=0, max_tokens=30
    )
    got = await c.complete(request(TextPrompt("Once upon a time there was a tiny model"), max_tokens=30))
    assert got.usage.prompt_tokens == len(expected["prompt_token_ids"])
    assert got.token_ids == expected["token_ids"] and got.text == expected["text"]


async def test_stop_token_ids_and_min_tokens_behave_as_in_vllm(c, direct):
    prompt = PROMPTS[1]
    base = await ref(direct, {"token_ids": prompt}, temperature=0, max_tokens=60, ignore_eos=True)
    ids = base["token_ids"]
    stop_id = next(t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i])
    for min_tokens in (0, ids.index(stop_id) + 2):
        expected = await ref(
            direct,
            {"token_ids": prompt},
            temperature=0,
            max_tokens=60,
            stop_token_ids=[stop_id],
            min_tokens=min_tokens,
            ignore_eos=True,
        )
        got = await c.complete(
            request(
                prompt,
                stop=StopConditions(
                    max_tokens=60, stop_token_ids=[stop_id], min_tokens=min_tokens, ignore_eos=True
                ),
            )
        )
        assert got.token_ids == expected["token_ids"]
        assert (got.finish_reason, got.stop_reason) == (expected["finish_reason"], expected["stop_reason"])
    assert expected["token_ids"] != ids  # the min_tokens run stopped later, at a repeat of the id


async def test_stop_strings_behave_as_in_vllm(c, direct):
    text_prompt = {"text": "The quick brown fox"}
    base = await ref(direct, text_prompt, temperature=0, max_tokens=60)
    ascii_text = base["text"]
    stop = next(
        ascii_text[i : i + 2]
        for i in range(8, len(ascii_text) - 2)
        if ascii_text[i : i + 2].isascii()
        and ascii_text[i : i + 2].strip()
        and ascii_text[i : i + 2] not in ascii_text[: i + 1]
    )
    for include in (False, True):
        expected = await ref(
            direct, text_prompt, temperature=0, max_tokens=60, stop=[stop], include_stop_str_in_output=include
        )
        got = await c.complete(
            request(
                TextPrompt("The quick brown fox"),
                stop=StopConditions(max_tokens=60, stop=[stop], include_stop_str_in_output=include),
            )
        )
        assert got.text == expected["text"] and got.token_ids == expected["token_ids"]
        assert got.finish_reason == "stop" and got.stop_reason == stop
        assert got.text.endswith(stop) == include


async def test_seeded_sampling_equals_direct(c, direct):
    prompt = PROMPTS[0]
    expected = await ref(
        direct, {"token_ids": prompt}, temperature=1.0, seed=1234, max_tokens=32, ignore_eos=True
    )
    got = await c.complete(
        request(
            prompt,
            sampling=SamplingOptions(temperature=1.0, seed=1234),
            stop=StopConditions(max_tokens=32, ignore_eos=True),
        )
    )
    assert got.token_ids == expected["token_ids"]


async def test_logprobs_are_the_engines(c, direct):
    prompt = PROMPTS[2]
    frames = [f async for f in c.generate(request(prompt, max_tokens=8, output=OutputOptions(logprobs=2)))]
    tokens = [f for f in frames if isinstance(f, TokensFrame)]
    lps = [lp for f in tokens for lp in f.logprobs]
    tops = [t for f in tokens for t in f.top_logprobs]
    assert len(lps) == 8 and all(lp <= 0 and math.isfinite(lp) for lp in lps)
    # greedy: the sampled token is the most likely one
    ids = [t for f in tokens for t in f.token_ids]
    assert all(max(top, key=top.get) == tid for top, tid in zip(tops, ids, strict=True))
    assert all(len(top) >= 2 for top in tops)


async def test_prompt_longer_than_the_context_names_the_limit(c):
    with pytest.raises(RequestFailed) as err:
        await c.complete(request(list(range(4, 504)) + [5] * 20, max_tokens=4))
    assert err.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED and "512" in str(err.value)
    with pytest.raises(RequestFailed) as err:
        await c.complete(request([5, 6, 7], max_tokens=600))
    assert err.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED and err.value.field == "$.stop.max_tokens"


async def test_invalid_parameters_name_the_field(c):
    with pytest.raises(RequestFailed) as err:
        await c.complete(request([5, 6], max_tokens=4, sampling=SamplingOptions(temperature=0, n=2)))
    assert err.value.code == ErrorCode.INVALID_REQUEST and err.value.field == "$.sampling.n"
    with pytest.raises(RequestFailed) as err:
        await c.complete(request([5, 9999], max_tokens=4))
    assert err.value.code == ErrorCode.INVALID_REQUEST


async def test_64_concurrent_requests_complete_within_the_workers_slots(c, shared_vllm):
    results: list = []
    peak_held = peak_waiting = 0

    async def one(i: int) -> None:
        results.append(
            await c.complete(
                request([4 + i, 9, 10 + i], stop=StopConditions(max_tokens=20 + i, ignore_eos=True))
            )
        )

    async def watch() -> None:
        nonlocal peak_held, peak_waiting
        while len(results) < 64:
            waiting, held = await consumer_counts(c.nc, c.names, TINY)
            peak_held, peak_waiting = max(peak_held, held), max(peak_waiting, waiting)
            await anyio.sleep(0.005)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        for i in range(64):
            tg.start_soon(one, i)
    counts = sorted(len(r.token_ids) for r in results)
    assert counts == [20 + i for i in range(64)]
    assert all(r.usage.completion_tokens == len(r.token_ids) for r in results)
    assert 0 < peak_held <= 16  # the shared worker runs with --slots 16
    assert peak_waiting > 0


async def _cancelled(c, worker) -> int:
    from jetllm.producer.fleet import instance_status

    return int((await instance_status(c.nc, c.names, worker.instance)).extra["cancelled"])


async def test_cancel_aborts_the_engine_request_and_frees_the_slot(c, shared_vllm):
    from jetllm.producer.fleet import instance_status
    from jetllm.producer.traces import trace_records

    before = await _cancelled(c, shared_vllm)
    long = functools.partial(request, [7, 8, 9], stop=StopConditions(max_tokens=480, ignore_eos=True))
    async with running_then_frozen(c, shared_vllm, long) as caught:
        req = caught.req
        await caught.stream.aclose()  # leaving the stream cancels the request
        try:
            with anyio.fail_after(10):  # with the engine frozen, only the cancel can end it
                while (
                    req.request_id in (await instance_status(c.nc, c.names, shared_vllm.instance)).request_ids
                ):
                    await anyio.sleep(0.05)
        except TimeoutError:  # where it waits, while the engine is still frozen (the report shows the log)
            await anyio.to_thread.run_sync(shared_vllm.dump_tasks)
            raise
    assert (await c.wait_result(req.request_id, timeout=10)).error.code.value == "cancelled"
    with anyio.fail_after(10):
        while await _cancelled(c, shared_vllm) == before:
            await anyio.sleep(0.05)
    # this request ended cancelled, not completed (another test's request may complete meanwhile)
    with anyio.fail_after(10):
        while not (
            hops := [
                r
                for r in await trace_records(c.js, c.names, req.request_id)
                if r.request_id == req.request_id
            ]
        ):
            await anyio.sleep(0.05)
    assert [r.outcome for r in hops] == ["cancelled"]
    # the engine's own scheduler dropped it too
    with anyio.fail_after(10):
        while True:
            status = await instance_status(c.nc, c.names, shared_vllm.instance)
            if status.extra["engine_running"] == "0" and status.engine_unfinished == 0:
                break
            await anyio.sleep(0.05)


async def test_sigusr1_shows_where_a_running_request_waits_and_the_worker_serves_on(c, shared_vllm):
    """What an operator sees of a request that does not move: its job's task, by request id,
    waiting on vLLM's output for it."""
    long = functools.partial(request, [4, 5, 6], stop=StopConditions(max_tokens=480, ignore_eos=True))
    async with running_then_frozen(c, shared_vllm, long) as caught:
        req = caught.req
        size = shared_vllm.log_size()
        await anyio.to_thread.run_sync(shared_vllm.dump_tasks)
        dump = shared_vllm.log_tail(5000, size)
        lines = [x for x in dump.splitlines() if x.strip().startswith(f"job {req.request_id}")]
        assert lines, f"no line for the request's job in:\n{dump[-4000:]}"
        assert any("engine/vllm_engine.py" in x and "vllm/v1/engine/async_llm.py" in x for x in lines), lines
        await caught.stream.aclose()
    done = await c.complete(request([1, 5, 6, 7, 8], max_tokens=4))
    assert done.usage.completion_tokens == 4


async def test_a_json_job_is_served_and_answered_in_json(c):
    async with RawInbox(c.nc, encoding="json") as inbox:
        body = (
            f'{{"v": 1, "request_id": "json-{uuid.uuid4().hex}", "model": "tiny", '
            '"prompt": {"type": "chat", "messages": [{"role": "user", "content": "hi"}]}, '
            f'"stop": {{"max_tokens": 5}}, "sampling": {{"temperature": 0}}, "reply_to": "{inbox.subject}"}}'
        ).encode()
        await publish_raw(c.nc, c.names, TINY, body, {"Content-Type": "application/json"})
        frames = await inbox.until_end()
    assert isinstance(frames[-1], FinalFrame)
    text = "".join(f.text for f in frames if isinstance(f, TokensFrame))
    assert frames[-1].usage.completion_tokens == 5 and isinstance(text, str)


async def test_a_prompt_that_ends_inside_a_character_streams_only_what_it_generates(c, direct, tiny_model):
    """vLLM's detokenizer would start such a request's text with its whole prompt's text and
    match its stop strings there (vLLM issue 48853). A request that continues after its worker
    died between the bytes of one character has such a prompt: the original prompt plus the
    tokens delivered so far. Its text and its stop strings must be as if it had not moved."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    chat = {"chat": [{"role": "user", "content": "write a short poem about the sea."}]}
    base = await ref(direct, chat, temperature=0, max_tokens=96)
    prompt, gen, text = base["prompt_token_ids"], base["token_ids"], base["text"]
    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    deltas = [stream.step(tok, t) or "" for t in gen]  # what vLLM emits for each token, unmoved
    assert "".join(deltas) == text
    k = next(
        k
        for k in range(4, len(gen) - 24)
        if tok.decode(prompt + gen[:k], skip_special_tokens=True).endswith("\ufffd")
    )
    rest = "".join(deltas[k:])

    def moved(**stop):
        return request(
            prompt + gen[:k],
            stop=StopConditions(max_tokens=len(gen) - k, **stop),
            output=OutputOptions(text=True),
        )

    got = await c.complete(moved())
    assert got.token_ids == gen[k:] and got.text == rest
    assert "sea." not in text
    got = await c.complete(moved(stop=["sea."]))  # in the prompt's text only: it does not stop
    assert got.token_ids == gen[k:] and got.text == rest and got.finish_reason == "length"
    head = text[: len(text) - len(rest)]
    s = next(
        rest[i : i + 2]
        for i in range(len(rest) - 2)
        if rest[i : i + 2].isascii()
        and rest[i : i + 2].strip()
        and rest[i : i + 2] not in head + rest[: i + 1]
    )
    for include in (False, True):
        expected = await ref(
            direct, chat, temperature=0, max_tokens=96, stop=[s], include_stop_str_in_output=include
        )
        got = await c.complete(moved(stop=[s], include_stop_str_in_output=include))
        assert got.token_ids == expected["token_ids"][k:] and expected["text"] == head + got.text
        assert got.finish_reason == "stop" and got.stop_reason == s


async def test_a_stream_interval_sends_the_same_tokens_in_fewer_frames(c):
    prompt = PROMPTS[1]
    every = [
        f async for f in c.generate(request(prompt, stop=StopConditions(max_tokens=40, ignore_eos=True)))
    ]
    coarse = [
        f
        async for f in c.generate(
            request(
                prompt,
                stop=StopConditions(max_tokens=40, ignore_eos=True),
                output=OutputOptions(stream_interval=8),
            )
        )
    ]

    def tokens(frames):
        return [len(f.token_ids) for f in frames if isinstance(f, TokensFrame)]

    assert sum(tokens(every)) == sum(tokens(coarse)) == 40
    assert [t for f in every if isinstance(f, TokensFrame) for t in f.token_ids] == [
        t for f in coarse if isinstance(f, TokensFrame) for t in f.token_ids
    ]
    # the first token at once, then eight at a time, the rest at the end; vLLM merges outputs a
    # busy consumer has not taken yet, so frames may be larger, never smaller
    assert all(n >= 8 for n in tokens(coarse)[1:-1]) and len(tokens(coarse)) <= 6, tokens(coarse)


async def test_a_cancel_lands_while_the_engine_has_not_made_a_step_for_the_request(c, shared_vllm):
    """The engine is frozen before the job is sent, so it has not taken the request when the
    producer cancels it right after `accepted`: the cancel still lands (result and count) without
    waiting for the engine."""
    from jetllm.producer.fleet import instance_status

    async def cancelled() -> int:
        return int((await instance_status(c.nc, c.names, shared_vllm.instance)).extra["cancelled"])

    before = await cancelled()
    req = request([7, 8, 10], stop=StopConditions(max_tokens=480, ignore_eos=True))
    with shared_vllm.engine_frozen():
        async for frame in c.generate(req):
            assert isinstance(frame, (PulledFrame, AcceptedFrame)), frame
            if isinstance(frame, AcceptedFrame):
                break
        with anyio.fail_after(10):
            result = await c.wait_result(req.request_id)
        assert result.error is not None and result.error.code.value == "cancelled"
        with anyio.fail_after(10):
            while await cancelled() == before:
                await anyio.sleep(0.05)


async def test_seeded_requests_whose_prompts_fill_more_than_a_step_do_not_kill_the_engine(c):
    """vLLM rewinds a seeded request's generator when a step prefilled only part of its prompt, and
    a CPU generator cannot rewind: the engine died. Here 24 seeded 400-token prompts at once are
    more than one step's token budget, so some prompt would be split across steps."""
    reqs = [
        request(
            [5 + (7 * i + k) % 500 for k in range(400)],
            max_tokens=4,
            sampling=SamplingOptions(temperature=1.0, seed=i),
        )
        for i in range(24)
    ]
    results: list = []

    async def one(r) -> None:
        results.append(await c.complete(r))

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for r in reqs:
                tg.start_soon(one, r)
    assert [len(r.token_ids) for r in results] == [4] * 24
