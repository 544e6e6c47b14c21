"""The job protocol (workers/protocol.py) as the one owner of a job's frames, without a server: a
role only asks, and what reaches the producer, the request log, the dead-letter stream and the
job's acknowledgement is the protocol's doing, in the order the durability story needs."""

from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
import nats.errors
import pytest
from nats.aio.msg import Msg

from jetllm.errors import EngineDead, RequestRejected
from jetllm.schemas import (
    AcceptedFrame,
    CancelRequest,
    Choice,
    DeadLetter,
    Delivered,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    Record,
    ResumeQuery,
    Steps,
    TokensFrame,
    Usage,
)
from jetllm.subjects import codec
from jetllm.subjects.names import Names
from jetllm.subjects.policy import QueuePolicy
from jetllm.workers.context import Counters, WorkerContext
from jetllm.workers.deadletters import DeadLetters
from jetllm.workers.jobs import decode_request
from jetllm.workers.protocol import JobDeps, JobRun
from jetllm.workers.requestlog import RequestLog
from jetllm.workers.roles import JobHandle, Role
from jetllm.workers.running import RunningRequests
from jetllm.workers.state import Lifecycle
from jetllm.workers.tasks import JobTasks
from jetllm.workers.tracing import TracePublisher

from .jobs import req

pytestmark = pytest.mark.anyio

REPLY = "_INBOX.producer.1"
QUERY = "query to " + REPLY
NAMES = Names("t")
_records = codec.KindDecoder(Record)


class Wire:
    """Everything the worker sends, in order: core publishes and JetStream publishes alike."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.rollups: list[str] = []
        """Subjects of the publishes that rolled their subject up (Nats-Rollup: sub)."""
        self.max_payload = 1 << 20
        self.encoding: codec.Encoding = "msgpack"
        """Of the frames (the job's own encoding)."""
        self.producer: Callable[[bytes], bytes] | None = None
        """Answers a ResumeQuery; None: no producer listens."""

    # the core connection
    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: Any = None, **kw: Any
    ) -> None:
        self.sent.append((subject, payload))
        if (headers or {}).get("Nats-Rollup") == "sub":
            self.rollups.append(subject)

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 1.0, **kw: Any) -> Any:
        if subject == REPLY:  # a worker taking a request over asks its producer
            self.sent.append((QUERY, payload))
            if self.producer is None:
                raise nats.errors.NoRespondersError
            return Msg(self, subject=REPLY, data=self.producer(payload))  # type: ignore[arg-type]
        self.sent.append((subject, payload))  # a settle confirmed by the server
        return None

    def jetstream(self, **kw: Any) -> Wire:
        return self

    @property
    def frames(self) -> list[Any]:
        return [
            codec.frame_decoder.decode(data, self.encoding) for subject, data in self.sent if subject == REPLY
        ]

    def kinds(self) -> list[str]:
        """The story in order: frames by kind, log records by type, dead letters, acks."""
        out = []
        for subject, data in self.sent:
            if subject == REPLY:
                frame = codec.frame_decoder.decode(data, self.encoding)
                out.append(f"{type(frame).__name__}:{getattr(frame, 'seq', '')}")
            elif subject == QUERY:
                query = codec.Decoder(ResumeQuery).decode(data, self.encoding)
                out.append(f"ResumeQuery:{query.after}")
            elif subject.startswith(NAMES.request_log_all.rstrip("*")):
                record = _records.decode(data)
                seqs = ",".join(str(f.seq) for f in record.frames) if isinstance(record, Steps) else ""
                out.append(type(record).__name__ + (f":{seqs}" if seqs else ""))
            elif subject.startswith("$JS.ACK"):
                out.append(data.decode().split(" ")[0] or "+ACK")
            elif subject == NAMES.dlq("generate", "fake"):
                out.append("dead-letter")
        return out

    def dead_letters(self) -> list[DeadLetter]:
        return [
            msgspec.msgpack.decode(d, type=DeadLetter)
            for s, d in self.sent
            if s == NAMES.dlq("generate", "fake")
        ]


class Script(Role):
    """A role that runs a test's script on the handle (no engine)."""

    name = "generate"
    queue = "generate"

    def __init__(self, script: Callable[[JobHandle], Awaitable[None]]) -> None:
        self.script = script

    def decode(self, data: bytes, headers: dict[str, str] | None) -> Any:
        return decode_request(data, headers)

    async def run(self, job: JobHandle) -> None:
        await self.script(job)

    async def canary(self, check: Any) -> Any:
        raise NotImplementedError


class NoPulls:
    async def stopped(self) -> None:
        pass


def job_msg(wire: Wire, data: bytes, headers: dict[str, str] | None = None, delivered: int = 1) -> Msg:
    return Msg(
        wire,
        subject=NAMES.jobs("generate", "fake"),
        reply=f"$JS.ACK.J.c.{delivered}.7.7.1700000000000000000.0",
        data=data,
        headers=headers,
    )


async def run_job(
    script: Callable[[JobHandle], Awaitable[None]],
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
    running: RunningRequests | None = None,
    during: Callable[[JobDeps], Any] | None = None,
    checkpoint_interval: float = 0.5,
    producer: Callable[[bytes], bytes] | None = None,
    wire: Wire | None = None,
    counters: Counters | None = None,
) -> tuple[Wire, JobDeps]:
    wire = wire if wire is not None else Wire()
    wire.producer = producer
    wire.encoding = codec.encoding_of(headers)
    ctx = WorkerContext(
        nc=wire,
        js=wire,
        names=NAMES,
        instance="w1",
        model="fake",  # type: ignore[arg-type]
        policy=QueuePolicy(),
        counters=counters if counters is not None else Counters(),
        errors=collections.Counter(),
    )
    running = running if running is not None else RunningRequests(wire)  # type: ignore[arg-type]
    tasks = JobTasks()
    deps = JobDeps(
        ctx=ctx,
        role=Script(script),
        running=running,
        log=RequestLog(wire, NAMES),  # type: ignore[arg-type]
        dead_letters=DeadLetters(ctx, "generate"),
        traces=TracePublisher(wire, NAMES),  # type: ignore[arg-type]
        tasks=tasks,
        pulls=NoPulls(),
        lifecycle=Lifecycle(running),
        checkpoint_interval=checkpoint_interval,
    )  # type: ignore[arg-type]
    if data is None:
        data = codec.encode(req("fake", request_id=f"r-{uuid.uuid4().hex[:6]}", reply_to=REPLY))
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tasks.open(tg)
            tg.start_soon(JobRun(deps, job_msg(wire, data, headers)).run)
            if during is not None:
                await during(deps)
    return wire, deps


async def completes(job: JobHandle) -> None:
    await job.claim()
    await job.accept()
    await job.tokens(0, [11], "a", None, None)
    await job.tokens(0, [12], "b", None, None)
    await job.finish(
        [Choice(index=0, finish_reason="length", completion_tokens=2)],
        Usage(prompt_tokens=3, completion_tokens=2),
        token_ids=[[11, 12]],
        text=["ab"],
    )


async def test_with_an_interval_of_zero_the_log_leads_every_frame_and_the_ack_comes_last():
    wire, deps = await run_job(completes, checkpoint_interval=0)
    assert wire.kinds() == [
        "PulledFrame:0",
        "Claim",
        "AcceptedFrame:0",
        "Steps:1",
        "TokensFrame:1",
        "Steps:2",
        "TokensFrame:2",
        "Result",
        "FinalFrame:3",
        "+ACK",
    ]
    # the result rolls the log up: its claim and steps go as it is stored, with no request of its own
    assert wire.rollups == [NAMES.request_log(wire.frames[0].request_id)]
    pulled = wire.frames[0]  # before the log is read: whom to ping, which delivery to NAK
    assert (pulled.worker, pulled.job_ack) == ("w1", wire.frames[1].job_ack) and pulled.job_ack
    c = deps.ctx.counters
    assert (c.acked, c.completed, c.dead_lettered, c.frames_sent) == (1, 1, 0, 5)


class CountsAtFinal(Wire):
    """Notes the worker's `completed` count as each final frame leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.counters = Counters()
        self.completed_at_final: list[int] = []

    async def publish(self, subject: str, payload: bytes = b"", *args: Any, **kw: Any) -> None:
        if subject == REPLY and isinstance(codec.frame_decoder.decode(payload, self.encoding), FinalFrame):
            self.completed_at_final.append(self.counters.completed)
        await super().publish(subject, payload, *args, **kw)


async def test_a_producer_that_saw_the_final_frame_finds_the_request_counted():
    """A test or an operator reads the worker's status right after the stream ended: the request
    is counted already, not after the ack's round trip (a loaded CI box read 45 of 40 this way)."""
    wire = CountsAtFinal()
    await run_job(completes, wire=wire, counters=wire.counters)
    assert wire.completed_at_final == [1]


async def test_by_default_a_short_request_logs_no_token_record_its_result_holds_them():
    wire, deps = await run_job(completes)
    assert wire.kinds() == [
        "PulledFrame:0",
        "Claim",
        "AcceptedFrame:0",
        "TokensFrame:1",
        "TokensFrame:2",
        "Result",
        "FinalFrame:3",
        "+ACK",
    ]


def _taking_over(after: int, expect: list[int]) -> Callable[[JobHandle], Awaitable[None]]:
    async def script(job: JobHandle) -> None:
        await job.claim(above=1, supersede=True)
        got = await job.delivered(after)
        assert [f.seq for f in got] == expect
        await job.accept(last_seq=expect[-1] if expect else after)
        await job.tokens(0, [99], None, None, None)
        await job.finish(
            [Choice(index=0, finish_reason="length", completion_tokens=1)],
            Usage(prompt_tokens=3, completion_tokens=1),
            token_ids=[[99]],
        )

    return script


async def test_a_takeover_asks_the_producer_and_logs_the_frames_it_adds_before_going_on():
    def producer(data: bytes) -> bytes:
        query = codec.Decoder(ResumeQuery).decode(data)
        assert query.attempt == 2 and query.after == 1
        held = [TokensFrame(seq=s, attempt=1, token_ids=[s]) for s in (2, 3, 5)]  # 4 never arrived
        return codec.encode(Delivered(frames=held))

    wire, _ = await run_job(_taking_over(1, [2, 3]), producer=producer)
    assert wire.kinds() == [
        "PulledFrame:0",
        "Claim",
        "ResumeQuery:1",
        "Steps:2,3",
        "AcceptedFrame:3",
        "TokensFrame:4",
        "Result",
        "FinalFrame:5",
        "+ACK",
    ]


async def test_a_takeover_with_no_producer_listening_goes_on_from_the_log():
    wire, _ = await run_job(_taking_over(1, []))
    kinds = wire.kinds()
    assert "ResumeQuery:1" in kinds and not any(k.startswith("Steps") for k in kinds)
    assert kinds[-3:] == ["Result", "FinalFrame:3", "+ACK"]


async def test_a_bug_after_the_final_frame_sends_no_second_terminal_frame():
    async def finishes_then_breaks(job: JobHandle) -> None:
        await completes(job)
        raise RuntimeError("after the end")

    wire, deps = await run_job(finishes_then_breaks)
    assert [type(f) for f in wire.frames].count(FinalFrame) == 1
    assert not any(isinstance(f, ErrorFrame) for f in wire.frames)
    assert wire.kinds()[-1] == "+ACK" and not wire.dead_letters()


async def test_a_bug_mid_stream_ends_the_request_with_one_internal_error_and_a_dead_letter():
    async def breaks(job: JobHandle) -> None:
        await job.claim()
        await job.accept()
        job.stage = "running it on the engine"
        await job.tokens(0, [11], "a", None, None)
        raise KeyError("lost")

    wire, deps = await run_job(breaks)
    assert wire.kinds() == [
        "PulledFrame:0",
        "Claim",
        "AcceptedFrame:0",
        "TokensFrame:1",
        "Result",
        "ErrorFrame:2",
        "dead-letter",
        "+TERM",
    ]
    err = wire.frames[-1]
    assert (
        err.code == ErrorCode.INTERNAL
        and err.message == "jetllm failed while running it on the engine: KeyError: 'lost'"
    )
    (dead,) = wire.dead_letters()
    assert dead.code == ErrorCode.INTERNAL and dead.reason == err.message
    assert deps.ctx.counters.dead_lettered == 1 and deps.ctx.errors["internal"] == 1


async def test_a_typed_error_from_the_role_is_the_producer_s_error_frame():
    async def refuses(job: JobHandle) -> None:
        raise RequestRejected(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long", field="$.prompt")

    wire, deps = await run_job(refuses)
    assert wire.kinds() == ["PulledFrame:0", "Result", "ErrorFrame:1", "dead-letter", "+TERM"]
    _, err = wire.frames
    assert err.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED and err.field == "$.prompt"


async def test_a_job_that_does_not_decode_is_answered_where_it_asked_to_be():
    called: list[JobHandle] = []

    async def never(job: JobHandle) -> None:
        called.append(job)

    bad = msgspec.json.encode(
        {
            "request_id": "r-bad",
            "model": "fake",
            "reply_to": REPLY,
            "max_token": 3,
            "prompt": {"type": "text", "text": "hi"},
        }
    )
    wire, _ = await run_job(never, bad, {"Content-Type": "application/json"})
    assert not called
    (err,) = wire.frames
    assert err.code == ErrorCode.INVALID_REQUEST and err.field == "$.max_token"
    assert wire.kinds() == ["Result", "ErrorFrame:1", "dead-letter", "+TERM"]


async def test_a_request_cancelled_before_it_started_ends_cancelled_with_its_result_stored():
    async def cancelled(job: JobHandle) -> None:
        job.cancelled("the producer left")

    wire, deps = await run_job(cancelled)
    assert wire.kinds() == ["PulledFrame:0", "Result", "ErrorFrame:1", "+TERM"]
    assert wire.frames[1].code == ErrorCode.CANCELLED and wire.frames[1].message == "the producer left"
    assert deps.ctx.counters.cancelled == 1


async def test_a_job_handed_back_records_its_hand_off_and_goes_back_to_the_queue():
    async def runs(job: JobHandle) -> None:
        await job.claim()
        await job.accept()
        await anyio.sleep_forever()

    async def drain(deps: JobDeps) -> None:
        while not deps.running:
            await anyio.sleep(0.01)
        deps.running.hand_back_all()

    wire, deps = await run_job(runs, during=drain)
    assert wire.kinds() == ["PulledFrame:0", "Claim", "AcceptedFrame:0", "Handoff", "-NAK"]
    assert deps.ctx.counters.handed_back == 1 and not deps.running


async def _unmarked_cancellation(job: JobHandle) -> None:
    """Runs until interrupted, then raises a fresh CancelledError without anyio's mark, as
    asyncio.gather does inside vLLM's prompt rendering when it is cancelled as its last child ends."""
    await job.claim()
    await job.accept()
    interrupted = False
    try:
        await anyio.sleep_forever()
    except anyio.get_cancelled_exc_class():
        interrupted = True
    if interrupted:
        raise asyncio.CancelledError()


def _cancel(deps: JobDeps, rid: str) -> Any:
    notice = CancelRequest(request_id=rid, reason="the producer left")
    return deps.running.on_cancel(Msg(None, subject=NAMES.cancel(rid), data=codec.encode(notice)))  # type: ignore[arg-type]


def _takeover(deps: JobDeps, rid: str) -> Any:
    notice = CancelRequest(request_id=rid, below_attempt=2)  # a newer delivery claimed it
    return deps.running.on_cancel(Msg(None, subject=NAMES.cancel(rid), data=codec.encode(notice)))  # type: ignore[arg-type]


async def _drain(deps: JobDeps, rid: str) -> None:
    deps.running.hand_back_all()


@pytest.mark.parametrize(
    "interrupt, kinds",
    [
        (_cancel, ["PulledFrame:0", "Claim", "AcceptedFrame:0", "Result", "ErrorFrame:1", "+TERM"]),
        (_drain, ["PulledFrame:0", "Claim", "AcceptedFrame:0", "Handoff", "-NAK"]),
        (_takeover, ["PulledFrame:0", "Claim", "AcceptedFrame:0"]),  # the newer delivery settles it
    ],
    ids=["cancel", "drain", "takeover"],
)
async def test_an_interruption_whose_cancellation_lost_anyios_mark_settles_as_the_interruption_says(
    interrupt, kinds, caplog
):
    rid = f"r-{uuid.uuid4().hex[:6]}"

    async def during(deps: JobDeps) -> None:
        while rid not in deps.running:
            await anyio.sleep(0.01)
        await interrupt(deps, rid)

    data = codec.encode(req("fake", request_id=rid, reply_to=REPLY))
    wire, deps = await run_job(_unmarked_cancellation, data, during=during)
    assert wire.kinds() == kinds
    assert not deps.running and "StrayCancellation" not in caplog.text


async def test_a_dead_engine_hands_the_job_back_without_a_hand_off_and_stops_the_worker():
    async def dies(job: JobHandle) -> None:
        await job.claim()
        raise EngineDead("EngineCore died")

    wire, deps = await run_job(dies)
    assert wire.kinds() == ["PulledFrame:0", "Claim", "-NAK"]  # a death counts against the request's budget
    assert deps.lifecycle.engine_dead and deps.lifecycle.stop_requested.is_set()


async def test_a_second_delivery_of_a_request_running_here_waits_for_the_first():
    called: list[JobHandle] = []

    async def never(job: JobHandle) -> None:
        called.append(job)

    running = RunningRequests(None)  # type: ignore[arg-type]
    running["r-dup"] = object()  # type: ignore[assignment]
    data = codec.encode(req("fake", request_id="r-dup", reply_to=REPLY))
    wire, deps = await run_job(never, data, running=running)
    assert not called and not wire.frames
    assert wire.sent[-1][1].startswith(b"-NAK") and b"delay" in wire.sent[-1][1]
    assert deps.ctx.counters.duplicates == 1


async def test_a_claim_numbers_the_attempt_above_the_log_and_tells_the_older_one_to_stop():
    async def takes_over(job: JobHandle) -> None:
        await job.claim(above=4, supersede=True)
        await job.accept()
        await job.tokens(0, [1], None, None, None)
        raise RequestRejected(ErrorCode.INVALID_REQUEST, "enough")

    wire, _ = await run_job(takes_over)
    (cancel,) = [d for s, d in wire.sent if s == NAMES.cancel(wire.frames[0].request_id)]
    assert b"superseded" in cancel and b"below_attempt" in cancel
    pulled, *rest = wire.frames
    assert pulled.attempt == 1 and {f.attempt for f in rest} == {5}  # the delivery's, then the claim's
    assert isinstance(rest[0], AcceptedFrame) and isinstance(rest[1], TokensFrame)
