"""What a request's frames say about each other, without a server."""

from __future__ import annotations

import anyio
import pytest

from jetllm.schemas import HeartbeatFrame, Record, Steps, TokensFrame, Usage
from jetllm.subjects import codec
from jetllm.workers.frames import FrameSink

pytestmark = pytest.mark.anyio


class SlowLog:
    """A connection whose request-log publishes wait until released."""

    def __init__(self) -> None:
        self.sent: list = []
        self.release = anyio.Event()

    async def publish(self, subject: str, data: bytes, headers=None, reply: str = "") -> None:
        if subject == "log":
            await self.release.wait()
            return
        self.sent.append(codec.frame_decoder.decode(data))


async def test_a_heartbeat_repeats_the_last_seq_sent_not_one_still_waiting_for_its_log_record():
    """A heartbeat ahead of the frames made producers fetch a 'lost' frame from the log."""
    nc = SlowLog()
    frames = FrameSink(nc, "inbox", "msgpack", "r", log_subject="log", checkpoint_interval=0)  # type: ignore[arg-type]
    nc.release.set()
    await frames.tokens(0, [5], None)
    nc.release = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(frames.tokens, 0, [6], None)  # waits for its log record
        await anyio.wait_all_tasks_blocked()
        await frames.heartbeat_if_idle(frames.last_sent + 10, interval=1.0)
        nc.release.set()
    kinds = [(type(f).__name__, f.seq) for f in nc.sent]
    assert kinds == [("TokensFrame", 1), ("HeartbeatFrame", 1), ("TokensFrame", 2)]
    assert isinstance(nc.sent[1], HeartbeatFrame) and isinstance(nc.sent[2], TokensFrame)


class Wire:
    """A connection that keeps, in order, what went to the log and what went to the producer."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    async def publish(self, subject: str, data: bytes, headers=None, reply: str = "") -> None:
        if subject == "log":
            self.sent.append(("log", codec.KindDecoder(Record).decode(data)))
        else:
            self.sent.append(("frame", codec.frame_decoder.decode(data)))


def _seqs(entry: tuple[str, object]) -> tuple[str, list[int]]:
    where, what = entry
    if isinstance(what, Steps):
        return where, [f.seq for f in what.frames]
    return where, [what.seq]  # type: ignore[attr-defined]


async def test_with_an_interval_of_zero_every_token_frame_is_logged_before_it_is_sent():
    nc = Wire()
    frames = FrameSink(nc, "inbox", "msgpack", "r", log_subject="log", checkpoint_interval=0)  # type: ignore[arg-type]
    for token in (5, 6, 7):
        await frames.tokens(0, [token], None)
    assert [_seqs(e) for e in nc.sent] == [
        ("log", [1]),
        ("frame", [1]),
        ("log", [2]),
        ("frame", [2]),
        ("log", [3]),
        ("frame", [3]),
    ]


async def test_frames_sent_between_checkpoints_are_logged_together_once():
    nc = Wire()
    frames = FrameSink(nc, "inbox", "msgpack", "r", log_subject="log", checkpoint_interval=3600)  # type: ignore[arg-type]
    for token in (5, 6, 7):
        await frames.tokens(0, [token], None)
    assert [_seqs(e) for e in nc.sent] == [("frame", [1]), ("frame", [2]), ("frame", [3])]
    await frames.checkpoint_if_due(frames.last_sent + 1)  # not due yet
    assert len(nc.sent) == 3
    await frames.checkpoint_if_due(frames.last_sent + 3601)
    await frames.checkpoint_if_due(frames.last_sent + 7202)  # nothing new: no empty record
    await frames.tokens(0, [8], None)
    await frames.checkpoint(0.0)
    logged = [_seqs(e) for e in nc.sent if e[0] == "log"]
    assert logged == [("log", [1, 2, 3]), ("log", [4])]
    (first, second) = (e[1] for e in nc.sent if e[0] == "log")
    assert isinstance(first, Steps) and [f.token_ids for f in first.frames] == [[5], [6], [7]]


async def test_only_the_accepted_and_the_last_frame_carry_the_trace_header():
    seen: list[tuple[str, dict | None]] = []

    class Headers:
        async def publish(self, subject: str, data: bytes, headers=None, reply: str = "") -> None:
            seen.append((type(codec.frame_decoder.decode(data)).__name__, headers))

    trace = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    frames = FrameSink(Headers(), "inbox", "msgpack", "r", headers=trace)  # type: ignore[arg-type]
    await frames.accepted("w", "m")
    await frames.tokens(0, [5], None)
    await frames.heartbeat_if_idle(frames.last_sent + 10, interval=1.0)
    await frames.send(frames.final_frame([], Usage(prompt_tokens=1, completion_tokens=1)))
    assert seen == [
        ("AcceptedFrame", trace),
        ("TokensFrame", None),
        ("HeartbeatFrame", None),
        ("FinalFrame", trace),
    ]


async def test_no_checkpoint_follows_the_end_of_a_request():
    """Readers take the log's last record for the result, and compaction keeps only the last."""
    nc = Wire()
    frames = FrameSink(nc, "inbox", "msgpack", "r", log_subject="log", checkpoint_interval=3600)  # type: ignore[arg-type]
    await frames.tokens(0, [5], None)
    final = frames.final_frame([], Usage(prompt_tokens=1, completion_tokens=1))
    await frames.checkpoint_if_due(frames.last_sent + 7200)  # the heartbeat tick, after the result was stored
    await frames.send(final)
    assert [where for where, _ in nc.sent] == ["frame", "frame"]
