"""What a request's frames say about each other, without a server."""

from __future__ import annotations

import anyio
import pytest

from jetllm.schemas import HeartbeatFrame, TokensFrame
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
    frames = FrameSink(nc, "inbox", "msgpack", "r", log_subject="log")  # type: ignore[arg-type]
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
