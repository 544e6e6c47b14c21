"""The puller's credit bookkeeping, and the puller against a fake connection (no server).

The fake stands for a nats-py connection and one pull consumer behind it. It serves waiting pull
requests round-robin, as nats-server does, delivers jobs with their own subject, and ends requests
with the statuses the server sends (408 with Nats-Pending-Messages, 409 without). It checks on
every pull request that the credit the server holds plus the running jobs never exceed the slots.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest
from nats.aio.msg import Msg

from jetllm.workers.pullcredit import PullCredit, Refusals
from jetllm.workers.puller import STRAY_DELAY, Puller

pytestmark = pytest.mark.anyio

# -- the bookkeeping: (step, total after it); steps: ("req", token, batch[, deadline]), ("got",),
# ("end", token, Nats-Pending-Messages or None), ("expire", now), ("clear",)

# fmt: off
CREDIT_CASES = {
    "every delivery uses one credit, none below zero": [
        (("req", "a", 3), 3), (("got",), 2), (("got",), 1), (("got",), 0), (("got",), 0),
    ],
    "a 408 returns what its request still had": [
        (("req", "a", 3), 3), (("got",), 2), (("end", "a", 2), 0),
    ],
    "served round-robin: each 408 corrects the total": [
        (("req", "a", 3), 3), (("req", "b", 3), 6),
        (("got",), 5), (("got",), 4), (("got",), 3), (("got",), 2),
        (("end", "a", 1), 1), (("end", "b", 1), 0),
    ],
    "served in order: the same deliveries, other headers, the same end": [
        (("req", "a", 3), 3), (("req", "b", 3), 6),
        (("got",), 5), (("got",), 4), (("got",), 3), (("got",), 2),
        (("end", "a", 0), 2), (("end", "b", 2), 0),
    ],
    "a 409 without the header returns its request's batch (refused on arrival)": [
        (("req", "a", 2), 2), (("req", "b", 2), 4), (("end", "b", None), 2),
    ],
    "a refused request keeps no credit a newer one used": [
        (("req", "a", 1), 1), (("req", "b", 1), 2), (("req", "c", 1), 3),
        (("got",), 2), (("end", "b", None), 1),
    ],
    "a status for a request not tracked changes nothing": [
        (("req", "a", 2), 2), (("end", "zz", 1), 2), (("clear",), 0), (("end", "a", 2), 0),
    ],
    "a request used up, then closed with nothing left": [
        (("req", "a", 1), 1), (("got",), 0), (("end", "a", 0), 0),
    ],
    "at its deadline a request the server never closed gives back what it had": [
        (("req", "a", 2, 10.0), 2), (("got",), 1), (("expire", 9.0), 1), (("expire", 11.0), 0),
    ],
    "at its deadline a request used up silently takes nothing from a newer one": [
        (("req", "a", 2, 10.0), 2), (("req", "b", 2, 12.0), 4),
        (("got",), 3), (("got",), 2), (("got",), 1),  # a, b, a: round-robin
        (("expire", 11.0), 1), (("expire", 13.0), 0),
    ],
    "a status that contradicts the deliveries leaves no credit the other requests cannot hold": [
        (("req", "a", 1), 1), (("req", "b", 1), 2), (("end", "a", 0), 1),
    ],
}
# fmt: on


@pytest.mark.parametrize("steps", CREDIT_CASES.values(), ids=CREDIT_CASES.keys())
def test_pull_credit(steps):
    credit = PullCredit()
    for i, (step, total) in enumerate(steps):
        match step:
            case ("req", token, batch):
                credit.requested(token, batch, deadline=100.0)
            case ("req", token, batch, deadline):
                credit.requested(token, batch, deadline=deadline)
            case ("got",):
                credit.delivered()
            case ("end", token, pending):
                credit.ended(token, pending)
            case ("expire", now):
                credit.expire(now)
            case ("clear",):
                credit.clear()
        assert credit.total == total, f"after step {i} {step}"


# -- the puller against a fake connection


class FakeSub:
    def __init__(self, sid: int, subject: str) -> None:
        self._id = sid
        self.subject = subject
        self._pending_size = 0
        self._pending_queue = None


class FakeJetStream:
    """The calls the puller makes on a nats-py connection, with one pull consumer behind them."""

    def __init__(self, room: Callable[[], int]) -> None:
        self._room = room
        self.is_connected = True
        self.subs: dict[int, FakeSub] = {}
        self._sids = itertools.count(1)
        self._inboxes = itertools.count(1)
        self._seqs = itertools.count(1)
        self.waiting: list[list] = []  # [reply, credit left], served from the front
        self.pulls: list[tuple[str, int]] = []
        self.naks: list[tuple[str, bytes]] = []
        self.unsubscribed: list[int] = []
        self.refuse_next = ""
        self.in_flight = 0
        """Jobs the server sends right before it sees an UNSUB (they arrive before the PONG)."""
        self._before_pong: list[Msg] = []

    @property
    def batches(self) -> list[int]:
        return [batch for _, batch in self.pulls]

    def credit(self) -> int:
        return sum(n for _, n in self.waiting)

    # the connection

    def new_inbox(self) -> str:
        return f"_INBOX.fake{next(self._inboxes)}"

    async def subscribe(self, subject: str) -> FakeSub:
        sub = FakeSub(next(self._sids), subject)
        self.subs[sub._id] = sub
        return sub

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "", headers=None) -> None:
        if not subject.startswith("$JS.API.CONSUMER.MSG.NEXT."):
            self.naks.append((subject, payload))
            return
        assert self.is_connected, "a pull request sent while disconnected"
        batch = json.loads(payload)["batch"]
        assert 0 < batch and self.credit() + batch <= self._room(), "more credit than free slots"
        self.pulls.append((reply, batch))
        if self.refuse_next:
            self._status(reply, "409", self.refuse_next)
            self.refuse_next = ""
        else:
            self.waiting.append([reply, batch])

    async def _send_unsubscribe(self, sid: int, limit: int = 0) -> None:
        inbox = self.subs[sid].subject[:-1]
        for _ in range(self.in_flight):
            self._before_pong.append(self._serve(inbox))
        self.in_flight = 0
        self.waiting = [w for w in self.waiting if not w[0].startswith(inbox)]  # no interest: dropped
        self.unsubscribed.append(sid)

    async def flush(self, timeout: int = 10) -> None:
        sent, self._before_pong = self._before_pong, []
        for to, msg in sent:
            self._send(to, msg)

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        del self.subs[sid]

    # the server

    def serve(self, n: int = 1) -> None:
        for _ in range(n):
            self._send(*self._serve(""))

    def expire(self) -> None:
        """The oldest waiting request times out."""
        reply, left = self.waiting.pop(0)
        pending = {"Nats-Pending-Messages": str(left), "Nats-Pending-Bytes": "0"}
        self._status(reply, "408", "Request Timeout", pending)

    def delete_consumer(self) -> None:
        waiting, self.waiting = self.waiting, []
        for reply, _ in waiting:
            self._status(reply, "409", "Consumer Deleted")

    def disconnect(self) -> None:
        """Our connection breaks: the server drops our waiting requests without a word."""
        self.is_connected = False
        self.waiting.clear()

    def _serve(self, inbox: str) -> tuple[str, Msg]:
        request = next(w for w in self.waiting if w[0].startswith(inbox))
        self.waiting.remove(request)
        request[1] -= 1
        if request[1] > 0:
            self.waiting.append(request)  # round-robin: to the back of the queue
        seq = next(self._seqs)
        ack = f"$JS.ACK.JOBS.w.1.{seq}.{seq}.0.0"
        return request[0], Msg(_client=self, subject="jetllm.t.jobs.generate.m", reply=ack, data=b"job")

    def _status(self, reply: str, code: str, desc: str, extra: dict[str, str] | None = None) -> None:
        headers = {"Status": code, "Description": desc, **(extra or {})}
        self._send(reply, Msg(_client=self, subject=reply, data=b"", headers=headers))

    def _send(self, to: str, msg: Msg) -> None:
        """To the subscription of a pull's reply subject; a job keeps its own subject."""
        for sub in self.subs.values():
            if sub.subject == to.rsplit(".", 1)[0] + ".*":
                sub._pending_queue.put_nowait(msg)


async def until(cond: Callable[[], object], timeout: float = 2.0) -> None:
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.002)


NAK = b"-NAK " + json.dumps({"delay": int(STRAY_DELAY * 1e9)}).encode()


class Worker:
    """Slots and running jobs around a puller, as the runtime keeps them."""

    def __init__(self, slots: int, expires: float) -> None:
        self.slots = slots
        self.paused = False
        self.running: list[Msg] = []
        self.asked = 0
        self.nc = FakeJetStream(room=lambda: self.slots - len(self.running))
        self.puller = Puller(
            self.nc, "JOBS", "w", free_slots=self.free_slots, on_job=self.running.append, expires=expires
        )

    def free_slots(self) -> int:
        self.asked += 1
        return 0 if self.paused else self.slots - len(self.running)

    async def turn(self) -> None:
        """Wake the puller and wait until it has decided again (it runs to its next wait at once)."""
        asked = self.asked
        self.puller.wake()
        await until(lambda: self.asked > asked)

    async def finish(self) -> None:
        self.running.pop(0)
        await self.turn()


@asynccontextmanager
async def pulling(slots: int, expires: float = 30.0) -> AsyncIterator[Worker]:
    w = Worker(slots, expires)
    async with anyio.create_task_group() as tg:
        tg.start_soon(w.puller.run)
        await until(lambda: w.nc.pulls)
        yield w
        w.puller.stop()


async def test_credit_is_used_by_deliveries_and_a_freed_slot_brings_a_pull():
    async with pulling(slots=3) as w:
        assert w.nc.batches == [3] and w.puller.outstanding == 3 and not w.puller.bound
        w.nc.serve(2)
        assert len(w.running) == 2 and w.puller.outstanding == 1 and w.puller.bound
        await w.turn()
        assert w.nc.batches == [3]  # 1 credit + 2 running fill the 3 slots
        await w.finish()
        assert w.nc.batches == [3, 1]
        w.nc.serve(2)  # one from each request, round-robin
        assert len(w.running) == 3 and w.puller.outstanding == 0
        await w.finish()
        await w.finish()
        assert w.nc.batches == [3, 1, 1, 1] and w.puller.pulled == 4


async def test_an_expired_pull_returns_the_credit_the_server_says_it_had():
    async with pulling(slots=4) as w:
        w.nc.serve(1)
        await w.finish()
        w.nc.serve(2)  # the first request (3 left) and the second (1 left), round-robin
        assert w.nc.waiting == [[w.nc.pulls[0][0], 2]] and w.puller.outstanding == 2
        w.nc.expire()  # 408, Nats-Pending-Messages: 2
        await until(lambda: len(w.nc.pulls) == 3)
        assert w.nc.batches == [4, 1, 2] and w.puller.outstanding == 2


async def test_a_pull_refused_on_arrival_ends_and_is_sent_again():
    async with pulling(slots=2) as w:
        w.nc.serve(1)
        w.nc.refuse_next = "Exceeded MaxWaiting"
        await w.finish()
        await until(lambda: len(w.nc.pulls) == 3)
        assert w.nc.batches == [2, 1, 1] and w.puller.outstanding == w.nc.credit() == 2


async def test_a_deleted_consumer_ends_the_waiting_pulls():
    async with pulling(slots=2) as w:
        w.nc.serve(1)
        w.nc.delete_consumer()  # 409 Consumer Deleted, no pending header
        await until(lambda: len(w.nc.pulls) == 2)
        assert w.nc.batches == [2, 1] and w.puller.outstanding == 1


async def test_a_pull_the_server_never_closed_is_forgotten_at_its_deadline():
    async with pulling(slots=2, expires=0.2) as w:
        w.nc.waiting.clear()  # e.g. the server restarted: no status will come
        await w.turn()
        assert w.nc.batches == [2] and w.puller.outstanding == 2
        await until(lambda: len(w.nc.pulls) == 2, timeout=5)  # expires + 1 s
        assert w.nc.batches == [2, 2]


async def test_no_pulls_while_disconnected_and_pulls_resume_after():
    async with pulling(slots=2, expires=0.2) as w:
        w.nc.serve(1)
        w.nc.disconnect()
        await w.finish()
        await until(lambda: w.puller.outstanding == 0, timeout=5)  # the lost request's deadline
        await w.turn()
        assert w.nc.batches == [2]  # the fake also fails any pull sent while disconnected
        w.nc.is_connected = True
        await until(lambda: len(w.nc.pulls) == 2)
        assert w.nc.batches == [2, 2] and w.puller.outstanding == 2


async def test_credit_without_a_free_slot_is_cancelled_with_a_fresh_inbox():
    async with pulling(slots=2) as w:
        (old_sid,) = w.nc.subs
        w.paused = True
        w.nc.serve(1)  # a job with no slot for it
        await until(lambda: w.nc.naks)
        assert not w.running and w.nc.naks == [("$JS.ACK.JOBS.w.1.1.1.0.0", NAK)]
        assert w.nc.unsubscribed == [old_sid] and old_sid not in w.nc.subs and len(w.nc.subs) == 1
        assert w.nc.waiting == [] and w.puller.outstanding == 0
        await w.turn()
        assert w.nc.batches == [2]  # paused: no pull
        w.paused = False
        await w.turn()
        assert w.nc.batches == [2, 2] and w.nc.pulls[1][0] != w.nc.pulls[0][0]


async def test_stop_pulls_no_more_hands_back_strays_and_sets_done():
    w = Worker(slots=3, expires=30.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(w.puller.run)
        await until(lambda: w.nc.pulls)
        w.nc.serve(2)
        w.nc.in_flight = 1  # on its way as the inbox closes: handled, not lost
        w.running.pop()  # a slot frees as the worker stops
        w.puller.wake()
        w.puller.stop()
        with anyio.fail_after(2):
            await w.puller.done.wait()
    assert w.nc.batches == [3] and len(w.running) == 1 and w.puller.pulled == 2
    assert w.nc.naks == [("$JS.ACK.JOBS.w.1.3.3.0.0", NAK)]
    assert w.nc.subs == {} and w.nc.waiting == [] and w.puller.outstanding == 0


# fmt: off
REFUSALS = [
    # (events, delay after them): "r" a refusal, "a" an answer (a job or a 408)
    ("r",       0.1),
    ("rr",      0.2),
    ("rrrr",    0.8),
    ("r" * 12,  5.0),
    ("rrra",    0.0),
    ("rrrar",   0.1),
]
# fmt: on


@pytest.mark.parametrize(("events", "delay"), REFUSALS)
def test_refused_pulls_back_off_and_an_answer_resets(events, delay):
    """A deleted consumer refuses every pull at once: without a back-off the puller spins."""
    r = Refusals()
    for i, e in enumerate(events):
        r.refused(float(i), "409 Consumer Deleted") if e == "r" else r.answered()
    assert r.delay == pytest.approx(delay)
    last = float(len(events) - 1)
    if events.endswith("r"):
        assert r.wait_left(last) == pytest.approx(delay)  # no pull until then
    else:
        assert r.wait_left(last) <= 0
