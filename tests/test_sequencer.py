"""The producer's frame sequencer, row by row: events in (frames, timer wake-ups, what the log and a
ping said), decisions out. No NATS: the rules of the stream on their own."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from jetllm.errors import RequestFailed
from jetllm.producer.sequencer import Decision, Sequencer, rest_of
from jetllm.schemas import (
    AcceptedFrame,
    Choice,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    HeartbeatFrame,
    PulledFrame,
    Result,
    ResumeQuery,
    TokensFrame,
    Usage,
)
from jetllm.subjects import codec

# -- frames, in short


def acc(attempt: int = 1, seq: int = 0, worker: str = "w1") -> AcceptedFrame:
    return AcceptedFrame(
        seq=seq, attempt=attempt, request_id="r", worker=worker, model="m", job_ack=f"ack.{worker}"
    )


def pul(attempt: int = 1, worker: str = "w1") -> PulledFrame:
    return PulledFrame(seq=0, attempt=attempt, request_id="r", worker=worker, job_ack=f"ack.{worker}")


def tok(seq: int, attempt: int = 1, ids: list[int] | None = None) -> TokensFrame:
    return TokensFrame(seq=seq, attempt=attempt, token_ids=ids if ids is not None else [seq * 10])


def beat(seq: int, attempt: int = 1) -> HeartbeatFrame:
    return HeartbeatFrame(seq=seq, attempt=attempt)


def fin(seq: int, attempt: int = 1) -> FinalFrame:
    return FinalFrame(
        seq=seq,
        attempt=attempt,
        request_id="r",
        choices=[Choice(index=0, finish_reason="length", completion_tokens=seq - 1)],
        usage=Usage(prompt_tokens=1, completion_tokens=seq - 1),
    )


def err(seq: int, attempt: int = 1) -> ErrorFrame:
    return ErrorFrame(seq=seq, attempt=attempt, request_id="r", code=ErrorCode.ENGINE_ERROR, message="boom")


def ended(tokens: int) -> Result:
    """A result in the log: `tokens` tokens (10, 20, ...), then the final frame."""
    return Result(attempt=1, final=fin(tokens + 1), token_ids=[[(i + 1) * 10 for i in range(tokens)]])


def unknown_kind(seq: int) -> bytes:
    """A frame kind from a newer worker (docs/messages.md: it repeats the last seq, like a heartbeat)."""
    return codec.encode({"kind": "progress", "seq": seq, "attempt": 1, "percent": 50})


# -- events: a frame (at time t), or one of these


def at(t: float, event: Any) -> tuple[float, Any]:
    return (t, event)


def wake(t: float, reconnects: int = 0, connected: bool = True) -> tuple[float, Any]:
    return (t, ("wake", connected, reconnects))


def filled(*frames: Any) -> tuple[None, Any]:
    return (None, ("filled", list(frames)))


def probed(gone: bool) -> tuple[None, Any]:
    return (None, ("probed", gone))


def looked_up(result: Result | None) -> tuple[None, Any]:
    return (None, ("looked_up", result))


def asked(attempt: int, after: int, request_id: str = "r") -> tuple[None, Any]:
    """A worker taking the request over asks what arrived after the log's last checkpoint."""
    return (None, ("resume", codec.encode(ResumeQuery(request_id=request_id, attempt=attempt, after=after))))


def label(frame: Any) -> str:
    if isinstance(frame, AcceptedFrame):
        return f"accepted#{frame.attempt}"
    if isinstance(frame, TokensFrame):
        return f"t{frame.seq}"
    if isinstance(frame, PulledFrame):
        return f"pulled#{frame.attempt}"
    return f"{frame.__struct_config__.tag}{frame.seq}"


def describe(d: Decision) -> str:
    parts = [label(f) for f in d.emit]
    if d.end:
        parts.append("end")
    if d.error is not None:
        parts.append(f"raise {type(d.error).__name__}")
    if d.drop is not None:
        parts.append("drop " + ("unknown kind" if "unknown kind" in d.drop else d.drop))
    if d.fill is not None:
        parts.append(f"fill {d.fill[0]}<seq<{d.fill[1]}")
    if d.lookup:
        parts.append("lookup")
    if d.probe is not None:
        parts.append(f"probe {d.probe}")
    if d.gone is not None:
        parts.append(f"gone {d.gone} nak {d.nak}")
    return " ".join(parts) or "-"


def play(events: list[Any], **options: Any) -> tuple[list[str], Sequencer]:
    seq = Sequencer("r", 0.0, **options)
    now = 0.0
    out = []
    for event in events:
        t, what = event if isinstance(event, tuple) else (None, event)
        now = t if t is not None else now
        if isinstance(what, bytes):
            d = seq.receive(what, now)
        elif not isinstance(what, tuple):
            d = seq.receive(codec.encode(what), now)
        elif what[0] == "wake":
            d = seq.wake(now, connected=what[1], reconnects=what[2])
        elif what[0] == "filled":
            d = seq.filled(what[1], now)
        elif what[0] == "probed":
            d = seq.probed(what[1], now)
        elif what[0] == "resume":
            answer = seq.resume(what[1])
            out.append("no answer" if answer is None else " ".join(["answer", *map(label, answer.frames)]))
            continue
        else:
            d = seq.looked_up(what[1], now)
        out.append(describe(d))
    return out, seq


FRAMES = [
    ("in order, to the final", [acc(), tok(1), tok(2), fin(3)], ["accepted#1", "t1", "t2", "final3 end"]),
    ("an error frame ends the stream", [acc(), tok(1), err(2)], ["accepted#1", "t1", "error2 end"]),
    (
        "duplicates are dropped",
        [acc(), tok(1), tok(2), tok(2), tok(1), tok(3)],
        ["accepted#1", "t1", "t2", "drop duplicate", "drop duplicate", "t3"],
    ),
    (
        "a repeated accepted is dropped",
        [acc(), acc(), tok(1)],
        ["accepted#1", "drop repeated accepted", "t1"],
    ),
    (
        "migration: the new attempt replays the log, is accepted, goes on at the next seq",
        [acc(), tok(1), tok(2), tok(1, 2), tok(2, 2), acc(2, seq=2, worker="w2"), tok(3, 2), fin(4, 2)],
        ["accepted#1", "t1", "t2", "drop duplicate", "drop duplicate", "accepted#2", "t3", "final4 end"],
    ),
    (
        "migration when the moved request's accepted frame was lost",
        [acc(), tok(1), tok(1, 2), tok(2, 2)],
        ["accepted#1", "t1", "drop duplicate", "t2"],
    ),
    (
        "frames of the superseded attempt are dropped",
        [acc(), tok(1), acc(2, seq=1, worker="w2"), tok(2, 1), beat(5, 1), fin(2, 1), tok(2, 2)],
        [
            "accepted#1",
            "t1",
            "accepted#2",
            "drop older attempt",
            "drop older attempt",
            "drop older attempt",
            "t2",
        ],
    ),
    (
        "heartbeats repeating the last seq pass nothing on",
        [acc(), beat(0), tok(1), beat(1), beat(1), tok(2)],
        ["accepted#1", "-", "t1", "-", "-", "t2"],
    ),
    (
        "a gap is filled from the log before the frame that revealed it",
        [acc(), tok(1), tok(4), filled(tok(2), tok(3))],
        ["accepted#1", "t1", "fill 1<seq<4", "t2 t3 t4"],
    ),
    (
        "a heartbeat ahead of what arrived reveals lost frames",
        [acc(), tok(1), beat(3), filled(tok(2), tok(3)), tok(4)],
        ["accepted#1", "t1", "fill 1<seq<4", "t2 t3", "t4"],
    ),
    (
        "a gap the log cannot fill fails the stream after what it had",
        [acc(), tok(1), tok(4), filled(tok(2))],
        ["accepted#1", "t1", "fill 1<seq<4", "t2 raise FrameGap"],
    ),
    (
        "a gap while the request ended: the log's result completes the stream",
        [acc(), tok(1), tok(3), filled(tok(2), tok(3), fin(4))],
        ["accepted#1", "t1", "fill 1<seq<3", "t2 t3 final4 end"],
    ),
    (
        "a lost final frame shows as a gap in the log's result",
        [acc(), tok(1), beat(2), filled(fin(2))],
        ["accepted#1", "t1", "fill 1<seq<3", "final2 end"],
    ),
    (
        "a frame kind this version does not know is skipped",
        [acc(), unknown_kind(0), tok(1), unknown_kind(1), fin(2)],
        ["accepted#1", "drop unknown kind", "t1", "drop unknown kind", "final2 end"],
    ),
    ("frames whose accepted was lost still pass", [tok(1), fin(2)], ["t1", "final2 end"]),
    (
        "a takeover is told the frames after the log's checkpoint; the old attempt's later ones are dropped",
        [
            acc(),
            tok(1),
            tok(2),
            tok(3),
            asked(2, after=1),
            tok(4),
            acc(2, seq=3, worker="w2"),
            tok(4, 2),
            fin(5, 2),
        ],
        [
            "accepted#1",
            "t1",
            "t2",
            "t3",
            "answer t2 t3",
            "drop older attempt",
            "accepted#2",
            "t4",
            "final5 end",
        ],
    ),
    (
        "a takeover the log is up to date for is told nothing new",
        [acc(), tok(1), asked(2, after=1), acc(2, seq=1, worker="w2"), tok(2, 2)],
        ["accepted#1", "t1", "answer", "accepted#2", "t2"],
    ),
    (
        "a question about another request, or not a question at all, is not answered",
        [acc(), tok(1), asked(2, after=0, request_id="other"), (None, ("resume", b"\xc1")), tok(2)],
        ["accepted#1", "t1", "no answer", "no answer", "t2"],
    ),
]


@pytest.mark.parametrize(("events", "decisions"), [r[1:] for r in FRAMES], ids=[r[0] for r in FRAMES])
def test_frames(events, decisions):
    assert play(events)[0] == decisions


TIMERS = [
    (
        "no worker accepts within accept_timeout",
        {"accept_timeout": 5.0},
        [wake(4.0), wake(5.0)],
        ["-", "raise AcceptTimeout"],
    ),
    (
        "a dead worker: its ping has no responders, the log has no result, the job moves on",
        {},
        [
            at(0, acc()),
            at(0.125, tok(1)),
            wake(0.375),
            probed(True),
            looked_up(None),
            at(0.5, acc(2, 1, "w2")),
            at(0.625, tok(1, 2)),
            at(0.75, tok(2, 2)),
        ],
        [
            "accepted#1",
            "t1",
            "probe w1",
            "lookup",
            "gone w1 nak ack.w1",
            "accepted#2",
            "drop duplicate",
            "t2",
        ],
    ),
    (
        "a slow worker (ping unanswered) is never given up on; the log is read every heartbeat_timeout",
        {},
        [
            at(0, acc()),
            wake(0.25),
            probed(False),
            wake(0.5),
            probed(False),
            wake(2.0),
            looked_up(None),
            wake(2.25),
            probed(False),
            at(2.3, tok(1)),
        ],
        ["accepted#1", "probe w1", "-", "probe w1", "-", "lookup", "-", "probe w1", "-", "t1"],
    ),
    (
        "a request that ended while its last frames were lost is completed from the log",
        {},
        [at(0, acc()), at(0.125, tok(1)), wake(2.125), looked_up(ended(2))],
        ["accepted#1", "t1", "lookup", "t2 final3 end"],
    ),
    (
        "a worker that died after the end: the log answers, no NAK",
        {},
        [at(0, acc()), at(0.125, tok(1)), wake(0.375), probed(True), looked_up(ended(3))],
        ["accepted#1", "t1", "probe w1", "lookup", "t2 final3 end"],
    ),
    (
        "heartbeats keep a quiet request from being pinged",
        {},
        [at(0, acc()), at(0.25, beat(0)), wake(0.25), wake(0.5)],
        ["accepted#1", "-", "-", "probe w1"],
    ),
    (
        "a frame kind it does not know is no sign of life",
        {},
        [at(0, acc()), at(0.2, unknown_kind(0)), wake(0.25)],
        ["accepted#1", "drop unknown kind", "probe w1"],
    ),
    (
        "cut off ourselves (a reconnect): no ping for heartbeat_timeout, the log is still read",
        {},
        [
            at(0, acc()),
            wake(0.25, reconnects=1),
            wake(2.0, reconnects=1),
            looked_up(None),
            wake(2.25, reconnects=1),
        ],
        ["accepted#1", "-", "lookup", "-", "probe w1"],
    ),
    (
        "a worker given up on that sends again (it was reconnecting) is watched again",
        {},
        [at(0, acc()), wake(0.25), probed(True), looked_up(None), at(0.375, tok(1)), wake(0.625)],
        ["accepted#1", "probe w1", "lookup", "gone w1 nak ack.w1", "t1", "probe w1"],
    ),
    (
        "a worker that dies after pulling the job, before accepting it: pinged, its delivery NAKed",
        {},
        [
            at(0, pul()),
            wake(0.125),
            wake(0.25),
            probed(True),
            at(0.5, pul(2, "w2")),
            at(0.6, acc(2, 0, "w2")),
        ],
        ["-", "-", "probe w1", "gone w1 nak ack.w1", "-", "accepted#2"],
    ),
    (
        "a worker that pulled the job and is slow to accept is not given up on",
        {},
        [at(0, pul()), wake(0.25), probed(False), wake(0.5), probed(False), at(0.6, acc()), at(0.7, tok(1))],
        ["-", "probe w1", "-", "probe w1", "-", "accepted#1", "t1"],
    ),
    (
        "once a worker accepted, a late pulled frame (of it or of an older delivery) changes nothing",
        {},
        [
            at(0, pul(2, "w2")),
            at(0.1, pul(1, "w1")),
            at(0.2, acc(2, 0, "w2")),
            at(0.3, pul(2, "w2")),
            wake(0.45),
        ],
        [
            "-",
            "drop pulled by an attempt already superseded",
            "accepted#2",
            "drop pulled by an attempt already superseded",
            "probe w2",
        ],
    ),
    (
        "migrate off: a pulled job is waited for, never pinged",
        {"migrate": False},
        [at(0, pul()), wake(0.25), at(0.3, acc())],
        ["-", "-", "accepted#1"],
    ),
    (
        "migrate off: silence for heartbeat_timeout fails the stream, without pings",
        {"migrate": False},
        [at(0, acc()), wake(1.0), wake(2.0)],
        ["accepted#1", "-", "raise WorkerSilent"],
    ),
    (
        "a wake-up that comes late, after frames arrived, does nothing",
        {},
        [at(0, acc()), at(0.3, tok(1)), wake(0.31)],
        ["accepted#1", "t1", "-"],
    ),
]


@pytest.mark.parametrize(
    ("options", "events", "decisions"), [r[1:] for r in TIMERS], ids=[r[0] for r in TIMERS]
)
def test_timers(options, events, decisions):
    assert play(events, **options)[0] == decisions


@pytest.mark.parametrize(
    ("options", "events", "deadline"),
    [
        ({}, [], None),  # no accept_timeout: wait for a worker as long as it takes
        ({"accept_timeout": 5.0}, [], 5.0),
        ({}, [at(1.0, acc())], 1.25),  # the first ping
        ({}, [at(1.0, acc()), at(1.25, beat(0))], 1.5),
        ({}, [at(1.0, acc()), at(1.25, tok(1)), at(1.5, tok(1))], 1.5),  # a duplicate moves nothing
        ({"probe_after": 5.0}, [at(1.0, acc())], 3.0),  # reading the log comes first then
        ({"migrate": False}, [at(1.0, acc())], 3.0),
        ({"accept_timeout": 5.0}, [at(1.0, acc()), wake(1.25), probed(True), looked_up(None)], 6.25),
        ({}, [at(1.0, pul())], 1.25),  # a worker holds it: ping it soon
        ({"accept_timeout": 5.0}, [at(4.9, pul())], 5.0),  # the accept timeout still comes first
        ({}, [at(1.0, pul()), wake(1.25), probed(True)], None),  # its delivery went back: wait again
        ({"migrate": False}, [at(1.0, pul())], None),
    ],
)
def test_deadline(options, events, deadline):
    assert play(events, **options)[1].deadline == deadline


def test_a_terminal_frame_marks_the_request_finished_before_it_is_yielded():
    """The caller may stop iterating at the final frame; the request must not be cancelled then."""
    _, seq = play([acc(), tok(1)])
    assert not seq.finished
    _, seq = play([acc(), tok(1), fin(2)])
    assert seq.finished and seq.last_seq == 2 and [f.seq for f in seq.seen] == [1]


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"\xc1", id="not msgpack"),
        pytest.param(codec.encode(tok(2), "json"), id="json to a msgpack reader"),
        pytest.param(
            msgspec.msgpack.encode({"kind": "tokens", "seq": "2", "attempt": 1}),
            id="a field of the wrong type",
        ),
    ],
)
def test_an_unreadable_frame_is_dropped_and_the_stream_goes_on(data):
    """Anyone who may publish to an inbox can send bytes; a lost real frame shows as a gap."""
    seq = Sequencer("r", 0.0)
    seq.receive(codec.encode(acc()), 0.0)
    seq.receive(codec.encode(tok(1)), 0.0)
    dropped = seq.receive(data, 0.0)
    assert dropped.drop is not None and dropped.drop.startswith("unreadable frame") and not dropped.emit
    after = seq.receive(codec.encode(tok(2)), 0.0)
    assert [f.seq for f in after.emit] == [2] and after.error is None


def fin_of(seq: int, *indexes: int) -> FinalFrame:
    choices = [Choice(index=i, finish_reason="length", completion_tokens=1) for i in indexes]
    return FinalFrame(
        seq=seq, request_id="r", choices=choices, usage=Usage(prompt_tokens=1, completion_tokens=len(indexes))
    )


FORGED_RESULTS = [
    pytest.param(
        Result(attempt=1, final=fin_of(3, 0, 1), token_ids=[[10], [20]], text=["a"]),
        None,
        "1 entries of text for 2 choices",
        id="text shorter than token_ids",
    ),
    pytest.param(
        Result(attempt=1, final=fin_of(3, 0), token_ids=[[10]], text=["a", "b"]),
        None,
        "2 entries of text for 1 choices",
        id="text longer than token_ids",
    ),
    pytest.param(
        Result(attempt=1, final=fin_of(3, 0, 1), token_ids=[[10], [20]], logprobs=[]),
        None,
        "0 entries of logprobs for 2 choices",
        id="logprobs shorter than token_ids",
    ),
    pytest.param(
        Result(attempt=1, final=fin_of(3, 0), token_ids=[[10], [20]], text=["a", "b"]),
        None,
        "its final frame lacks choice 1",
        id="a final frame missing a choice the lists have",
    ),
    pytest.param(
        Result(attempt=1, final=fin_of(3, 0, 0), token_ids=[[10]]),
        None,
        "names choice 0 more than once",
        id="a final frame naming a choice twice",
    ),
    pytest.param(
        Result(attempt=1, final=fin_of(3, 0, 1), token_ids=[[10]]),
        None,
        "names choice 1",
        id="a final frame naming a choice the lists lack",
    ),
    pytest.param(
        Result(attempt=1, final=fin_of(3), token_ids=[]),
        None,
        "output of no choice",
        id="a final frame with nothing at all",
    ),
    pytest.param(
        Result(attempt=1, final=fin_of(3, 0, 1), token_ids=[[10], [20]], text=["a", "b"]),
        1,
        "the output of 2 choices; the request has 1",
        id="more choices than the request has",
    ),
    pytest.param(
        Result(attempt=1, token_ids=[[10]], text=["a"]),
        None,
        "neither a final nor an error frame",
        id="no end at all",
    ),
]


@pytest.mark.parametrize(("result", "choices", "says"), FORGED_RESULTS)
def test_a_result_in_the_log_that_does_not_fit_the_request_fails_it_with_a_typed_error(result, choices, says):
    """Anyone who may publish to the request log can write a Result: one that does not fit fails
    the request (RequestFailed, internal) where a fitting one would complete it, never IndexError."""
    seq = Sequencer("r", 0.0, **({} if choices is None else {"choices": choices}))
    seq.receive(codec.encode(acc()), 0.0)
    seq.receive(codec.encode(tok(1)), 0.0)
    d = seq.looked_up(result, 2.0)
    assert isinstance(d.error, RequestFailed) and d.error.code == ErrorCode.INTERNAL, d
    assert says in d.error.message and d.error.message.startswith("internal: r: "), d.error.message
    assert not d.emit and not d.end and not seq.finished  # a forged result: its request is cancelled
    with pytest.raises(RequestFailed, match=says):  # the log's other readers (results.py) likewise
        rest_of(result, [], 0, **({} if choices is None else {"n": choices}))


@pytest.mark.parametrize(
    ("result", "choices"),
    [
        pytest.param(ended(2), 1, id="one choice"),
        pytest.param(
            Result(attempt=1, final=fin_of(3, 1, 0), token_ids=[[10], [20]], text=["a", "b"]),
            2,
            id="two choices",
        ),
        pytest.param(
            Result(
                attempt=1,
                error=ErrorFrame(seq=2, request_id="r", code=ErrorCode.ENGINE_ERROR, message="x"),
            ),
            1,
            id="an error without output",
        ),
    ],
)
def test_a_result_that_fits_still_completes_the_stream(result, choices):
    for n in (choices, None):
        seq = Sequencer("r", 0.0, choices=n)
        seq.receive(codec.encode(acc()), 0.0)
        seq.receive(codec.encode(tok(1)), 0.0)
        d = seq.looked_up(result, 2.0)
        assert (
            d.error is None and d.end and seq.finished and isinstance(d.emit[-1], (FinalFrame, ErrorFrame))
        ), d
