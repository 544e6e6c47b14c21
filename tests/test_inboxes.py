"""Where a client's frames land (jetllm/producer/inboxes.py), without a server: a frame reaches its
own request's inbox, a batch is split in order, nothing unreadable or foreign lands anywhere, and
a request whose wait ran out is woken once."""

import time

import anyio
import msgspec
import pytest
from nats.aio.msg import Msg

from jetllm.producer.inboxes import Inboxes
from jetllm.schemas import BatchedFrame, FrameBatch

ROOT = "_INBOX.abc"


def msg(subject: str, data: bytes, reply: str = "") -> Msg:
    return Msg(_client=None, subject=subject, data=data, reply=reply)  # type: ignore[arg-type]


def batch(*entries: tuple[str, bytes]) -> bytes:
    return msgspec.msgpack.encode(
        FrameBatch(
            frames=[BatchedFrame(to=to, frame=msgspec.Raw(msgspec.msgpack.encode(f))) for to, f in entries]
        )
    )


def drained(inboxes: Inboxes, *tokens: str) -> dict[str, list]:
    out = {}
    for t in tokens:
        inbox = inboxes._open[t]
        out[t] = list(inbox.items)
        inbox.items.clear()
    return out


@pytest.mark.parametrize(
    ("subject", "data", "want"),
    [
        (f"{ROOT}.a", b"f1", {"a": [b"f1"], "b": []}),
        (f"{ROOT}.b", b"f2", {"a": [], "b": [b"f2"]}),
        (f"{ROOT}.gone", b"f3", {"a": [], "b": []}),  # a request that ended: dropped
        (f"{ROOT}.batch", batch((f"{ROOT}.b", "x"), (f"{ROOT}.a", "y"), (f"{ROOT}.b", "z")), None),
        (f"{ROOT}.batch", b"\xc1not msgpack", {"a": [], "b": []}),  # unreadable: dropped, no raise
        (f"{ROOT}.batch", batch(("_INBOX.other.a", "x"), (f"{ROOT}.nobody", "y")), {"a": [], "b": []}),
    ],
    ids=["frame-a", "frame-b", "ended", "batch-in-order", "unreadable-batch", "foreign-batch"],
)
def test_a_frame_reaches_only_its_own_requests_inbox(subject, data, want):
    inboxes = Inboxes(ROOT)
    inboxes.open("a")
    inboxes.open("b")
    inboxes.on_message(msg(subject, data))
    got = drained(inboxes, "a", "b")
    if want is None:  # a batch: each entry is the frame's own encoding, in the worker's order
        want = {
            "a": [msgspec.msgpack.encode("y")],
            "b": [msgspec.msgpack.encode("x"), msgspec.msgpack.encode("z")],
        }
    assert got == want


def test_a_question_from_a_worker_arrives_as_a_message_to_answer():
    inboxes = Inboxes(ROOT)
    inboxes.open("a")
    query = msg(f"{ROOT}.a", b"q", reply="_INBOX.worker.1")
    inboxes.on_message(query)
    assert drained(inboxes, "a") == {"a": [query]}


def test_subjects_are_under_the_root_and_closed_inboxes_get_nothing():
    inboxes = Inboxes(ROOT)
    assert inboxes.subject("t1") == f"{ROOT}.t1"
    inboxes.open("t1")
    inboxes.close("t1")
    inboxes.close("t1")  # twice is harmless: a request's cleanup may run after a failure
    inboxes.on_message(msg(f"{ROOT}.t1", b"late"))
    assert "t1" not in inboxes._open


@pytest.mark.anyio
async def test_a_request_whose_wait_ran_out_is_woken_once_and_others_are_not():
    inboxes = Inboxes(ROOT)
    late = inboxes.open("late")
    waiting = inboxes.open("waiting")
    late.deadline = time.monotonic() + 0.05
    waiting.deadline = time.monotonic() + 60
    async with anyio.create_task_group() as tg:
        tg.start_soon(inboxes.watch)
        with anyio.fail_after(5):
            assert await late.get() is None  # the wake-up
        await anyio.sleep(0.3)  # several watchdog periods: no second wake-up for the same deadline
        tg.cancel_scope.cancel()
    assert list(late.items) == [] and late.deadline is None
    assert list(waiting.items) == [] and waiting.deadline is not None
