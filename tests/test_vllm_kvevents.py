"""KV-cache events of a real vLLM worker, read back from JetStream as a router would."""

from __future__ import annotations

import anyio
import pytest

from jetllm.producer import Client
from jetllm.producer.kvevents import kv_events
from jetllm.schemas import (
    ControlDone,
    ControlFailed,
    ErrorCode,
    KvCleared,
    KvEventBatch,
    KvStored,
    StopConditions,
)
from jetllm.subjects import codec

from .conftest import TINY
from .jobs import kv_batches, kv_blocks, req

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

BLOCK = 32
_reply = codec.Decoder(ControlDone | ControlFailed)


def stored_blocks(batches: list[KvEventBatch]) -> list[tuple[int, int | None, list[int]]]:
    """(hash, parent, tokens) of every block the batches store, in order (snapshots left out)."""
    out = []
    for b in batches:
        if b.resync is not None:
            continue
        for ev in b.events:
            if isinstance(ev, KvStored):
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    out.append((h, parent, ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]))
                    parent = h
    return out


async def test_a_prompts_blocks_a_cache_reset_and_a_resync_reach_jetstream_in_order(
    nats_url, namespace, start_worker
):
    """A greedy request's full blocks arrive as stored events with exactly its tokens (chained by
    parent hash); a prefix-cache reset shows as a cleared event at once; a reader starting late at
    seq N replays N, N+1, ... with no gap; kv-resync publishes a cleared event plus the blocks the
    engine now holds, which is what applying every event so far gives."""
    w = start_worker(namespace, "--kv-events")
    instance = await w.wait_ready(nats_url)
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=60) as c:
        nc, names = c.nc, c.names

        async def batches(until) -> list[KvEventBatch]:
            return await kv_batches(nc, names, TINY, instance, until)

        async def control(verb: str) -> ControlDone | ControlFailed:
            reply = await nc.request(names.instance_control(instance, verb), b"", timeout=30)
            return _reply.decode(reply.data)

        start = await batches(lambda b: len(b) >= 1)
        assert start[0].seq == 1 and start[0].resync is not None and start[0].resync.reason == "start"

        prompt = [10 + (i * 7) % 300 for i in range(80)]  # 2 full blocks and half of a third
        done = await c.complete(req(TINY, prompt, stop=StopConditions(max_tokens=40, ignore_eos=True)))
        seq_ids = prompt + done.token_ids  # 120 tokens, 119 of them computed: 3 full blocks
        got = await batches(lambda b: len(stored_blocks(b)) >= 3)
        blocks = stored_blocks(got)
        assert [tokens for _, _, tokens in blocks] == [seq_ids[i * BLOCK : (i + 1) * BLOCK] for i in range(3)]
        assert blocks[0][1] is None and blocks[1][1] == blocks[0][0] and blocks[2][1] == blocks[1][0]
        assert all(b.instance == instance and b.model == TINY and b.dp_rank == 0 for b in got)

        with anyio.fail_after(30):
            while isinstance(answer := await control("reset-prefix-cache"), ControlFailed):
                assert answer.code == ErrorCode.CONFLICT, answer  # blocks still held: try again
                await anyio.sleep(0.2)
        seen = len(got)
        got = await batches(lambda b: any(KvCleared() in x.events and x.resync is None for x in b[seen:]))
        assert kv_blocks(ev for b in got for ev in b.events) == {}

        second = [400 + i for i in range(70)]
        done2 = await c.complete(req(TINY, second, stop=StopConditions(max_tokens=10, ignore_eos=True)))
        got = await batches(lambda b: len(stored_blocks(b)) >= 5)
        live = kv_blocks(ev for b in got for ev in b.events)
        seq2 = second + done2.token_ids
        assert sorted(live.values()) == sorted([seq2[:BLOCK], seq2[BLOCK : 2 * BLOCK]])

        answer = await control("kv-resync")
        assert isinstance(answer, ControlDone), answer
        seen = len(got)
        got = await batches(
            lambda b: any(x.resync is not None and x.resync.reason == "requested" for x in b[seen:])
        )
        snapshot = [x for x in got[seen:] if x.resync is not None and x.resync.reason == "requested"]
        assert snapshot[0].events[0] == KvCleared() and snapshot[-1].resync.part == snapshot[-1].resync.parts
        assert kv_blocks(ev for b in snapshot for ev in b.events) == live

        n = 2
        late = [d async for d in kv_events(nc, names, TINY, instance=instance, start_seq=n, follow=False)]
        assert [d.batch.seq for d in late] == list(range(n, got[-1].seq + 1))
        assert [d.batch for d in late] == got[n - 1 :] and not any(d.missed for d in late)
