"""A decode worker's view of its own engine's prefix cache, and the local prefill it leads to.
The real engine: test_vllm_disagg.py."""

from __future__ import annotations

import os
import uuid

import anyio
import pytest

from jetllm.producer import Client
from jetllm.producer.fleet import instance_status
from jetllm.router.hashing import DEFAULT_SEED, BlockHasher
from jetllm.schemas import KvCleared, KvRemoved, KvStored
from jetllm.workers.cachedblocks import CachedBlocks
from jetllm.workers.config import DisaggSettings
from jetllm.workers.engine import EngineFacts, KvEventSource
from jetllm.workers.kvview import BlockSet
from jetllm.workers.roles.decode import DecodeRole

from .conftest import inproc_worker
from .fake_engine import FakeEngine
from .jobs import prefill_note, req
from .test_kvevents import EnginePublisher

SIZE = 4
HASHER = BlockHasher(SIZE)
PROMPT = list(range(100, 124))  # 6 blocks
IDS = HASHER.chain(PROMPT)


def stored(ids: list[int], parent: int | None = None, **kw) -> KvStored:
    return KvStored(
        block_hashes=ids, parent_block_hash=parent, token_ids=[0] * SIZE * len(ids), block_size=SIZE, **kw
    )


@pytest.mark.parametrize(
    ("events", "cached"),
    [
        ([], 0),
        ([stored(IDS[:3], medium="GPU")], 12),
        ([stored(IDS, medium="GPU")], 24),
        ([stored(IDS)], 24),  # no medium: an engine that does not say
        ([stored(IDS[1:])], 0),  # vLLM hits a prefix only: without the first block nothing counts
        ([stored(IDS), KvRemoved(block_hashes=[IDS[2]], medium="GPU")], 8),
        ([stored(IDS), KvRemoved(block_hashes=[IDS[2]], medium="CPU")], 24),
        ([stored(IDS), KvCleared()], 0),
        ([stored(IDS), KvCleared(), stored(IDS[:2])], 8),
        ([stored(IDS, lora_name="sql")], 0),  # an adapter's blocks are not the base prompt's
        ([stored(IDS, medium="CPU")], 0),  # offloaded: not this engine's prefix cache
    ],
)
def test_the_cached_share_of_a_prompt_follows_the_engines_events(events, cached):
    blocks = CachedBlocks(HASHER)
    blocks.apply(0, events)
    assert blocks.cached_tokens(PROMPT) == cached
    assert blocks.cached_tokens(PROMPT + [1, 2, 3]) == cached  # a partial last block never counts


def test_ranks_are_kept_apart_and_the_longest_prefix_of_one_rank_counts():
    blocks = CachedBlocks(HASHER)
    blocks.apply(0, [stored(IDS[:2])])
    blocks.apply(1, [stored([IDS[0], IDS[2], IDS[3]])])  # no block 1: its prefix ends at block 0
    assert blocks.cached_tokens(PROMPT) == 8
    blocks.apply(1, [stored([IDS[1]])])
    assert blocks.cached_tokens(PROMPT) == 16
    blocks.apply(0, [KvCleared()])
    assert blocks.cached_tokens(PROMPT) == 16
    assert len(blocks) == 4


def test_memory_is_bounded_by_the_limit_oldest_out():
    blocks = CachedBlocks(HASHER, limit=4)
    blocks.apply(0, [stored(IDS)])
    assert len(blocks) == 4 and blocks.cached_tokens(PROMPT) == 0  # the first two blocks went
    blocks.apply(0, [stored(IDS[:2])])
    assert blocks.cached_tokens(PROMPT) == 8  # 0 and 1 are back, and 2 and 3 made room for them


def test_a_resync_snapshot_replaces_the_view():
    relay_view = BlockSet()
    relay_view.apply([stored(IDS[:3], medium="GPU")])
    blocks = CachedBlocks(HASHER)
    blocks.apply(0, [stored([7, 8, 9], medium="GPU")])
    blocks.apply(0, relay_view.as_events())
    assert len(blocks) == 3 and blocks.cached_tokens(PROMPT) == 12


@pytest.mark.parametrize(
    ("facts", "follows"),
    [
        ({}, False),  # no events
        ({"kv_events": True, "prefix_hash_algo": "sha256"}, True),
        ({"kv_events": True, "prefix_hash_algo": "sha256_cbor"}, True),
        ({"kv_events": True, "prefix_hash_algo": "xxhash"}, False),  # a seed this worker cannot know
        ({"kv_events": True, "prefix_hash_algo": None}, False),  # no prefix caching
        ({"kv_events": True, "prefix_hash_algo": "sha256", "block_size": None}, False),
    ],
)
def test_only_an_engine_whose_block_ids_can_be_reproduced_is_followed(facts, follows):
    facts = dict(facts)
    sources = {0: KvEventSource(endpoint="ipc://x")} if facts.pop("kv_events", False) else {}
    f = EngineFacts(model="m", max_model_len=128, block_size=facts.pop("block_size", 16), kv_events=sources)
    f.prefix_hash_algo = facts.pop("prefix_hash_algo", None)
    assert (CachedBlocks.for_engine(f) is not None) == follows


# A decode worker on the light engine, its KV events from a stand-in for vLLM's publisher. No
# prefill worker serves this namespace, so a prompt that is not cached enough is prefilled here for
# that reason instead: the two reasons tell the cases apart.

ENGINE_BLOCK = 16
LONG = [3 + i % 90 for i in range(150)]  # 9 full blocks, over the threshold (64)


def engine_stored(ids: list[int], parent: int | None, tokens: list[int]) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": ids,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": ENGINE_BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


@pytest.mark.anyio
async def test_a_decode_worker_prefills_a_prompt_its_engine_holds_mostly_cached(
    nats_url, namespace, tmp_path
):
    ids = BlockHasher(ENGINE_BLOCK, seed=os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)).chain(LONG)
    pub = EnginePublisher(tmp_path)
    engine = FakeEngine()
    engine.facts.kv_events = {0: pub.source}
    engine.facts.prefix_hash_algo = "sha256"
    disagg = DisaggSettings(block_dir=str(tmp_path), threshold=64)
    config = {"namespace": namespace, "instance": "dec-1", "disagg": disagg}
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pub.serve_replay)
            async with (
                inproc_worker(nats_url, engine, role=DecodeRole, **config) as w,
                Client(nats_url, namespace=namespace) as c,
            ):
                follower = w.kv_events.follower
                assert follower is not None

                async def run(seq: int, event: dict, blocks: int) -> str | None:
                    await pub.send(seq, event)
                    with anyio.fail_after(10):
                        while len(follower) != blocks:
                            await anyio.sleep(0.02)
                    r = req("fake", LONG, request_id=f"r-{uuid.uuid4().hex}")
                    await c.complete(r)
                    return await prefill_note(c, r.request_id)

                tokens = LONG[: 4 * ENGINE_BLOCK]
                note = await run(0, engine_stored(ids[:4], None, tokens), 4)  # 64 of 150: under half
                assert note == "local: no prefill worker"
                tokens = LONG[4 * ENGINE_BLOCK : 5 * ENGINE_BLOCK]
                note = await run(1, engine_stored(ids[4:5], ids[3], tokens), 5)
                assert note == "local: cached (80 of 150 prompt tokens in this engine's prefix cache)"
                removed = {"type": "BlockRemoved", "block_hashes": [ids[0]], "medium": "GPU"}
                note = await run(2, removed, 4)  # evicted: the prefix is broken at its first block
                assert note == "local: no prefill worker"
                s = await instance_status(c.nc, c.names, "dec-1")
                assert s.extra["prefill_local_cached"] == "1"
                assert s.extra["prefill_local_no_prefill_worker"] == "2"
            tg.cancel_scope.cancel()
    finally:
        pub.close()
