"""Frames of many requests to one producer as one message per event-loop turn (workers/framebatch.py)."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
import pytest

from jetllm.producer import Client
from jetllm.schemas import BatchedFrame, FinalFrame, FrameBatch, TokensFrame
from jetllm.subjects import codec
from jetllm.workers.framebatch import FrameBatcher, batch_subject, split
from jetllm.workers.frames import FrameSink

from .conftest import inproc_worker
from .jobs import req

pytestmark = pytest.mark.anyio

H = codec.FRAME_BATCH_HEADER

BATCH_SUBJECTS = [
    ("no header: frames go singly", None, "_INBOX.p.r1", "msgpack", None),
    ("the reply subject's .batch sibling", {H: "_INBOX.p.batch"}, "_INBOX.p.r1", "msgpack", "_INBOX.p.batch"),
    ("JSON frames are not batched", {H: "_INBOX.p.batch"}, "_INBOX.p.r1", "json", None),
    ("a detached job has nobody to batch for", {H: "_INBOX.p.batch"}, None, "msgpack", None),
    ("another producer's subject", {H: "_INBOX.q.batch"}, "_INBOX.p.r1", "msgpack", None),
    ("jetllm's own subjects", {H: "jetllm.default.jobs.batch"}, "jetllm.default.jobs.x", "msgpack", None),
    ("a wildcard", {H: "_INBOX.*.batch"}, "_INBOX.*.r1", "msgpack", None),
    ("the reply subject itself", {H: "_INBOX.p.batch"}, "_INBOX.p.batch", "msgpack", None),
]


@pytest.mark.parametrize(
    ("headers", "reply_to", "encoding", "expected"),
    [r[1:] for r in BATCH_SUBJECTS],
    ids=[r[0] for r in BATCH_SUBJECTS],
)
def test_batch_subject(headers, reply_to, encoding, expected):
    assert batch_subject(headers, reply_to, encoding) == expected


def _frames(n: int) -> list[BatchedFrame]:
    return [BatchedFrame(to=f"r{i}", frame=msgspec.Raw(b"\x90")) for i in range(n)]


SPLITS = [
    ("all fit", [10, 10, 10], 30, [3]),
    ("cut where the next would not fit", [10, 10, 10], 25, [2, 1]),
    ("one bigger than the limit goes alone", [5, 50, 5], 20, [1, 1, 1]),
    ("nothing", [], 10, []),
]


@pytest.mark.parametrize(("sizes", "limit", "parts"), [r[1:] for r in SPLITS], ids=[r[0] for r in SPLITS])
def test_split(sizes, limit, parts):
    assert [len(p) for p in split(_frames(len(sizes)), sizes, limit)] == parts


class Wire:
    max_payload = 1 << 20

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    async def publish(self, subject: str, data: bytes, headers=None, reply: str = "") -> None:
        self.sent.append((subject, codec.Decoder(FrameBatch).decode(data)))


async def test_frames_sent_in_one_turn_leave_as_one_message_per_producer_in_order():
    nc = Wire()
    batcher = FrameBatcher(nc)  # type: ignore[arg-type]
    sinks = [
        FrameSink(nc, f"_INBOX.{p}.r{i}", "msgpack", f"{p}{i}", batch=(batcher, f"_INBOX.{p}.batch"))  # type: ignore[arg-type]
        for p in ("a", "b")
        for i in range(3)
    ]
    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        for round_ in range(2):
            async with anyio.create_task_group() as step:  # one engine step: every request sends
                for i, sink in enumerate(sinks):
                    step.start_soon(sink.tokens, 0, [round_ * 10 + i], None)
            await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert [subject for subject, _ in nc.sent] == ["_INBOX.a.batch", "_INBOX.b.batch"] * 2
    for subject, batch in nc.sent:
        p = subject.split(".")[1]
        assert [f.to for f in batch.frames] == [f"_INBOX.{p}.r{i}" for i in range(3)]
    tokens = [codec.frame_decoder.decode(f.frame).token_ids[0] for _, b in nc.sent for f in b.frames]
    assert tokens == [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15]
    assert all(s.frames_sent == 2 for s in sinks)


async def test_a_frame_added_as_the_batcher_stops_is_still_sent():
    nc = Wire()
    batcher = FrameBatcher(nc)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(batcher.run)
        await anyio.wait_all_tasks_blocked()
        batcher.add("_INBOX.a.batch", "_INBOX.a.r1", codec.encode(TokensFrame(seq=1, token_ids=[7])))
        tg.cancel_scope.cancel()
    assert [len(b.frames) for _, b in nc.sent] == [1]


async def test_a_client_s_concurrent_requests_get_their_frames_in_fewer_messages(
    nats_url, namespace, fake_engine
):
    """Every stream is whole and in order, and the producer gets fewer messages than frames."""
    async with (
        Client(nats_url, namespace=namespace) as client,
        inproc_worker(nats_url, fake_engine, namespace=namespace),
    ):
        sub = await client.nc.subscribe(f"{client._inboxes.root}.>")  # a second listener
        outs: dict[int, list] = {}

        async def one(i: int) -> None:
            outs[i] = [f async for f in client.generate(req("fake", [i + 1, 2, 3], max_tokens=40))]

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(one, i)
        messages = 0
        with anyio.move_on_after(1):
            while True:
                await sub.next_msg(timeout=5)  # the scope ends the loop, not a timeout
                messages += 1
        await sub.unsubscribe()
    frames = sum(len(o) for o in outs.values())
    assert messages < frames / 2, (messages, frames)
    for o in outs.values():
        assert isinstance(o[-1], FinalFrame) and o[-1].usage.completion_tokens == 40
        assert sum(len(f.token_ids) for f in o if isinstance(f, TokensFrame)) == 40
        seqs = [f.seq for f in o[1:]]
        assert seqs == list(range(1, len(seqs) + 1))
