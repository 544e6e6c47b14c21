"""The KV-event relay against a stand-in for vLLM's ZMQ publisher (same wire format), so lost
engine batches, replays and resyncs can be produced on purpose. The real engine: test_vllm_fleet.py."""

from __future__ import annotations

import subprocess
import sys
import time

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

from jetllm.schemas import ControlDone, ControlFailed, KvCleared, KvEventBatch, KvRemoved, KvStored
from jetllm.subjects import codec
from jetllm.subjects.connection import connect
from jetllm.subjects.names import Names
from jetllm.workers.engine import KvEventSource

from .conftest import inproc_worker
from .fake_engine import FakeEngine
from .jobs import kv_batches, kv_blocks

pytestmark = pytest.mark.anyio

_reply = codec.Decoder(ControlDone | ControlFailed)


class EnginePublisher:
    """vLLM's ZmqEventPublisher as seen from outside: PUB (topic, seq, payload) plus a replay ROUTER."""

    def __init__(self, directory) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"ipc://{directory}/pub")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"ipc://{directory}/replay")
        self.source = KvEventSource(
            endpoint=f"ipc://{directory}/pub", replay_endpoint=f"ipc://{directory}/replay"
        )
        self.buffer: dict[int, bytes] = {}

    async def send(self, seq: int, *events: dict, live: bool = True, keep: bool = True) -> None:
        payload = msgspec.msgpack.encode([time.time(), list(events), 0])
        if keep:
            self.buffer[seq] = payload
        if live:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def serve_replay(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            for seq in sorted(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart(
                        [ident, b"", b"", seq.to_bytes(8, "big"), self.buffer[seq]]
                    )
            await self.router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": None,
    }


def removed(hashes: list[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


async def test_relay_numbers_batches_without_gaps_recovers_lost_ones_and_resyncs(
    nats_url, namespace, tmp_path
):
    """Engine batches reach JetStream in order, each numbered 1, 2, 3, ... per instance; one the
    relay missed live is taken from the replay socket; one that is gone for good becomes a resync
    (cleared + the live blocks); the kv-resync verb and a prefix-cache reset publish at once; a
    restarted instance keeps counting; a late reader replays from seq N; so does `jetllm kv-events`."""
    engine_pub = EnginePublisher(tmp_path)
    names = Names(namespace)
    nc = await connect(nats_url)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine_pub.serve_replay)
            engine = FakeEngine()
            engine.facts.kv_events = {0: engine_pub.source}
            async with inproc_worker(nats_url, engine, namespace=namespace, instance="kv-1"):
                first = await kv_batches(nc, names, "fake", "kv-1", lambda b: len(b) >= 1)
                assert first[0].seq == 1 and first[0].resync is not None and first[0].resync.reason == "start"
                assert first[0].events == [KvCleared()] and first[0].model == "fake"

                a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
                await engine_pub.send(0, stored([11, 12], None, a + b))
                await engine_pub.send(1, stored([13], 12, c))
                await engine_pub.send(2, removed([13]), live=False)  # PUB/SUB lost it; the replay has it
                await engine_pub.send(3, stored([14], 12, [0, 0, 0, 1]))
                got = await kv_batches(nc, names, "fake", "kv-1", lambda b: len(b) >= 5)
                assert [x.seq for x in got] == [1, 2, 3, 4, 5]
                assert [x.engine_seq for x in got[1:]] == [0, 1, 2, 3]
                assert got[1].events == [
                    KvStored(block_hashes=[11, 12], token_ids=a + b, block_size=4, medium="GPU")
                ]
                assert got[2].events[0].parent_block_hash == 12 and got[3].events == [
                    KvRemoved(block_hashes=[13], medium="GPU")
                ]

                await engine_pub.send(4, removed([11]), live=False, keep=False)  # gone for good
                await engine_pub.send(5, removed([14]))
                got = await kv_batches(nc, names, "fake", "kv-1", lambda b: len(b) >= 6)
                gap = got[5]
                assert gap.resync is not None and gap.resync.reason == "engine-gap" and gap.resync.parts == 1
                assert gap.events[0] == KvCleared()
                # the relay's view: block 11 is still there (its removal was lost), 14 is gone (seen)
                assert kv_blocks(gap.events) == {11: a, 12: b}

                async def resync() -> ControlDone:
                    reply = await nc.request(names.instance_control("kv-1", "kv-resync"), b"", timeout=15)
                    answer = _reply.decode(reply.data)
                    assert isinstance(answer, ControlDone), answer
                    return answer

                done = await resync()
                got = await kv_batches(nc, names, "fake", "kv-1", lambda b: len(b) >= 7)
                assert got[6].resync is not None and got[6].resync.reason == "requested"
                assert kv_blocks(got[6].events) == {11: a, 12: b} and "seq 7..7: 2 blocks" in done.detail

                reply = await nc.request(
                    names.instance_control("kv-1", "reset-prefix-cache"), b"", timeout=15
                )
                assert isinstance(_reply.decode(reply.data), ControlDone)
                got = await kv_batches(nc, names, "fake", "kv-1", lambda b: len(b) >= 8)
                assert got[7].events == [KvCleared()] and got[7].resync is None

            engine2 = FakeEngine()
            engine2.facts.kv_events = {0: engine_pub.source}
            async with inproc_worker(nats_url, engine2, namespace=namespace, instance="kv-1"):
                got = await kv_batches(nc, names, "fake", "kv-1", lambda b: len(b) >= 9)
                assert got[8].seq == 9 and got[8].resync is not None and got[8].resync.reason == "start"
                # the stand-in engine still holds batches 0..5 for replay: the new relay takes them
                # after its start snapshot, as it would after a restart of the worker alone
                late = await kv_batches(nc, names, "fake", "kv-1", lambda b: len(b) >= 1, start_seq=3)
                assert [x.seq for x in late][:7] == [3, 4, 5, 6, 7, 8, 9]

                out = await anyio.to_thread.run_sync(
                    lambda: subprocess.run(
                        [
                            sys.executable,
                            "-m",
                            "jetllm",
                            "kv-events",
                            "--nats",
                            nats_url,
                            "--namespace",
                            namespace,
                            "--model",
                            "fake",
                            "--instance",
                            "kv-1",
                            "--from-seq",
                            "4",
                        ],
                        capture_output=True,
                        text=True,
                        timeout=60,
                    )
                )
                assert out.returncode == 0, out.stderr
                lines = [msgspec.json.decode(line, type=KvEventBatch) for line in out.stdout.splitlines()]
                assert [x.seq for x in lines][:6] == [4, 5, 6, 7, 8, 9]
            tg.cancel_scope.cancel()
    finally:
        await nc.close()
        engine_pub.close()


async def test_a_worker_without_kv_events_says_so(nats_url, namespace):
    async with inproc_worker(nats_url, FakeEngine(), namespace=namespace, instance="plain") as w:
        reply = await w.nc.request(Names(namespace).instance_control("plain", "kv-resync"), b"", timeout=5)
        answer = _reply.decode(reply.data)
        assert isinstance(answer, ControlFailed) and "--kv-events" in answer.message


def test_batches_too_big_for_one_message_are_split_along_block_boundaries():
    """A long prompt's stored chain (or a large snapshot) is split into messages under the server's
    max_payload; applied in order they give the same blocks, each chained to the one before."""
    from jetllm.workers.kvview import chunks

    ev = KvStored(
        block_hashes=list(range(1, 201)), token_ids=list(range(70_000, 70_000 + 200 * 16)), block_size=16
    )
    limit = 4096
    parts = chunks([KvCleared(), ev, KvRemoved(block_hashes=[5])], limit)
    assert len(parts) > 1
    for part in parts:
        assert len(codec.encode(KvEventBatch(instance="i", model="m", seq=1, events=part))) < limit
    flat = [e for part in parts for e in part]
    assert kv_blocks(flat) == {h: ev.token_ids[(h - 1) * 16 : h * 16] for h in range(1, 201) if h != 5}
    stored_parts = [e for e in flat if isinstance(e, KvStored)]
    assert [p.parent_block_hash for p in stored_parts[1:]] == [p.block_hashes[-1] for p in stored_parts[:-1]]


def test_older_vllm_array_events_and_unknown_kinds_are_read():
    from jetllm.workers.kvsource import decode_engine_batch

    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                ["BlockStored", [2**64 - 1], None, [1, 2], 2, None, "GPU"],
                {"type": "SomethingNew", "x": 1},
                ["AllBlocksCleared"],
            ],
            None,
        ]
    )
    ts, rank, events = decode_engine_batch(payload)
    assert (ts, rank) == (1.0, None)
    assert events == [
        KvStored(block_hashes=[2**64 - 1], token_ids=[1, 2], block_size=2, medium="GPU"),
        KvCleared(),
    ]
