"""The KV-aware router against two real vLLM workers (one fleet for the whole file, 2 engine
start-ups): its predicted prefix hits equal the engine's `usage.cached_tokens`, its tokenizer
renders text and chat prompts as the worker does, a restarted router is right from its first job,
and a routed job runs on the worker the router chose."""

from __future__ import annotations

import concurrent.futures
import random
import uuid

import anyio
import pytest

from jetllm.producer import Client
from jetllm.producer.registry import instances
from jetllm.router import Router
from jetllm.schemas import (
    ChatMessage,
    ChatPrompt,
    GenerateRequest,
    KvEventBatch,
    SamplingOptions,
    StopConditions,
    TextPrompt,
    TokensPrompt,
)
from jetllm.subjects import codec

from .conftest import TINY, WorkerProcess, require_vllm, stop_all

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

_batch = codec.Decoder(KvEventBatch)


@pytest.fixture(scope="module")
def fleet(nats_url, tiny_model, tmp_path_factory):
    """Two workers publishing KV events, in a namespace of their own."""
    require_vllm()
    namespace = f"r{uuid.uuid4().hex[:10]}"
    logs = tmp_path_factory.mktemp("router-fleet")
    workers = [
        WorkerProcess(nats_url, namespace, tiny_model, logs / f"w{i}.log", "--kv-events", "--slots", "4")
        for i in range(2)
    ]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(anyio.run, w.wait_ready, nats_url, 900.0) for w in workers]:
                f.result()
        yield namespace, workers
    finally:
        stop_all(workers)


def job(prompt, max_tokens: int = 4, **kw) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"r-{uuid.uuid4().hex}",
        model=TINY,
        prompt=prompt,
        sampling=SamplingOptions(temperature=0),
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
        **kw,
    )


def workload() -> list[GenerateRequest]:
    """Token, text and chat prompts sharing prefixes (in groups and across turns), and unrelated ones."""
    rnd = random.Random(7)
    base = [rnd.randrange(10, 400) for _ in range(200)]
    system = "You are a terse assistant for the shipping desk. " * 6
    out = []
    for i in range(8):
        out.append(job(TokensPrompt(base[: 100 + 12 * i] + [rnd.randrange(10, 400) for _ in range(30)])))
        out.append(job(TextPrompt(system + f"Question {i}: where is parcel {i * 37}?")))
        out.append(
            job(
                ChatPrompt(
                    [ChatMessage(role="system", content=system), ChatMessage(role="user", content=f"hi {i}")]
                )
            )
        )
    turns = [ChatMessage(role="system", content=system)]
    for t in range(6):
        turns = [*turns, ChatMessage(role="user", content=f"turn {t}: and the next parcel?")]
        out.append(job(ChatPrompt(list(turns))))
        turns = [*turns, ChatMessage(role="assistant", content=f"parcel {t} is in bay {t * 3}")]
    for _ in range(4):
        out.append(job(TokensPrompt([rnd.randrange(10, 400) for _ in range(rnd.randrange(20, 150))])))
    return out


async def caught_up(c: Client, router: Router, workers: list[WorkerProcess]) -> None:
    """Until the router applied every KV batch the workers published (and they stopped publishing)."""
    assert router.feed is not None
    stable, previous, applied, last = 0, None, {}, {}
    for _ in range(300):
        last = {}
        for w in workers:
            subject = c.names.kv_events(TINY, w.instance)
            raw = await c.js.get_last_msg(c.names.kv_events_stream, subject)
            last[w.instance] = _batch.decode(raw.data).seq
        applied = {w.instance: router.feed.last.get(w.instance) for w in workers}
        stable = stable + 1 if last == previous and applied == last else 0
        if stable >= 3:
            return
        previous = last
        await anyio.sleep(0.1)
    raise AssertionError(f"router behind: stream {last}, applied {applied}, {router.feed.counters}")


async def test_predicted_hits_equal_the_engines_cached_tokens_and_a_restarted_router_is_warm(
    nats_url, fleet, tiny_model
):
    namespace, workers = fleet
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=60) as c:
        router = Router(TINY, tokenizer=str(tiny_model), trace=False)
        await router.start(c.nc, c.names)
        try:
            matched, hits, rows = 0, 0, []
            reqs = workload()
            for r in reqs:
                await caught_up(c, router, workers)
                tokens = router.tokenizer.tokens(r.prompt)
                predicted = router.overlaps(tokens)
                done = await c.complete(r)
                assert len(tokens) == done.usage.prompt_tokens, r.prompt  # rendered as the worker does
                expected = predicted.get(done.worker, 0)
                matched += expected == done.usage.cached_tokens
                hits += done.usage.cached_tokens > 0
                rows.append((type(r.prompt).__name__, expected, done.usage.cached_tokens))
            print(f"router predictions: {matched}/{len(reqs)} equal the engine's cached tokens, {hits} hits")
            assert matched >= 0.95 * len(reqs), rows
            assert hits >= len(reqs) // 3, rows  # the workload does share prefixes

            # a prompt only one worker has seen, then a router started afresh; long enough that
            # its cached part outweighs the holder looking busy (a fresh router's first load figure
            # is the registry's, which may date from this very job)
            unique = job(TokensPrompt([random.Random(3).randrange(10, 400) for _ in range(320)]))
            first = await c.complete(unique)
            with anyio.fail_after(30):  # the engine reports stored blocks a little after the job ends
                while router.overlaps(list(unique.prompt.token_ids)).get(first.worker, 0) < 288:
                    await anyio.sleep(0.05)
            await caught_up(c, router, workers)
        finally:
            await router.close()

        fresh = Router(TINY, tokenizer=str(tiny_model), trace=False)
        async with fresh.running(c.nc, c.names):
            again = job(unique.prompt)
            choice = fresh.decide(again, fresh.tokenizer.tokens(again.prompt))
            assert choice.instance == first.worker, choice
            assert fresh.overlaps(list(unique.prompt.token_ids)) == {first.worker: 288}

        records = await instances(c.js, c.names, model=TINY)
        assert all(rec.cached_blocks for rec in records), records  # what `jetllm status` shows


async def test_a_job_sharing_a_long_prefix_runs_on_the_worker_that_holds_it(nats_url, fleet, tiny_model):
    namespace, workers = fleet
    router = Router(TINY, tokenizer=str(tiny_model))
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=60) as plain:
        prefix = [random.Random(11).randrange(10, 400) for _ in range(300)]
        first = await plain.complete(job(TokensPrompt(prefix + [5, 6, 7])))
        async with Client(nats_url, namespace=namespace, heartbeat_timeout=60, router=router) as c:
            await caught_up(c, router, workers)
            with anyio.fail_after(20):
                done = await c.complete(job(TokensPrompt(prefix + [8, 9, 10, 11])), accept_timeout=10)
            assert done.worker == first.worker and done.usage.cached_tokens == 288
