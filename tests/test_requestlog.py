"""How a request's log is read: who owned it, what was delivered, how often workers died."""

from __future__ import annotations

import pytest

from jetllm.schemas import (
    Cancelled,
    Choice,
    ChoiceLogprobs,
    Claim,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    Handoff,
    Result,
    Step,
    TokensFrame,
    Usage,
)
from jetllm.subjects import codec
from jetllm.workers.requestlog import analyze, fitted, read_cancel, with_cancel


def step(attempt: int, seq: int, *tokens: int, index: int = 0) -> Step:
    return Step(
        attempt=attempt, frame=TokensFrame(seq=seq, attempt=attempt, index=index, token_ids=list(tokens))
    )


def test_an_empty_log_is_a_fresh_request():
    h = analyze([])
    assert h.fresh and h.deaths == 0 and h.frames == []


def test_delivered_tokens_are_gathered_in_seq_order_across_attempts():
    h = analyze(
        [
            Claim(attempt=1, worker="a", at=0),
            step(1, 1, 10),
            step(1, 2, 11),
            Claim(attempt=2, worker="b", at=1),
            step(2, 3, 12),
        ]
    )
    assert h.tokens(1) == [[10, 11, 12]] and h.last_seq == 3
    assert h.deaths == 2  # attempt 2 is not the current one: it died too


def test_a_superseded_attempt_cannot_change_what_was_delivered():
    h = analyze(
        [
            Claim(attempt=1, worker="a", at=0),
            step(1, 1, 10),
            Claim(attempt=2, worker="b", at=1),
            step(1, 2, 99),
            step(2, 2, 11),
        ]
    )
    assert h.tokens(1) == [[10, 11]]


def test_planned_handoffs_do_not_count_as_deaths():
    h = analyze(
        [
            Claim(attempt=1, worker="a", at=0),
            step(1, 1, 5),
            Handoff(attempt=1, reason="draining"),
            Claim(attempt=2, worker="b", at=1),
            step(2, 2, 6),
        ]
    )
    assert h.handoffs == 1 and h.deaths == 1


def test_a_result_ends_the_story_even_if_a_cancel_came_later():
    err = ErrorFrame(seq=1, request_id="r", code=ErrorCode.CANCELLED, message="x")
    done = Result(attempt=1, error=err)
    assert analyze([Claim(attempt=1, worker="a", at=0), done, Cancelled(attempt=0)]).result == done
    assert analyze([Cancelled(attempt=0)]).cancelled is not None


_DONE = Result(attempt=1, error=ErrorFrame(seq=1, request_id="r", code=ErrorCode.INTERNAL, message="x"))
_CLAIMED = [Claim(attempt=1, worker="a", at=0), step(1, 1, 5)]


@pytest.mark.parametrize(
    "records, cancel, cancelled, owner",
    [
        ([], None, False, None),
        ([], Cancelled(attempt=0, reason="r"), True, None),
        (_CLAIMED, Cancelled(attempt=0), True, None),  # its worker died: the next one does not resume it
        (_CLAIMED, None, False, "a"),
        ([*_CLAIMED, _DONE], Cancelled(attempt=0), False, None),  # ended before the cancel: the end stands
    ],
)
def test_a_durable_cancel_counts_until_the_request_ended(records, cancel, cancelled, owner):
    h = with_cancel(analyze(records), cancel)
    assert (h.cancelled is not None, h.owner) == (cancelled, owner)
    assert h.result == (_DONE if _DONE in records else None)
    assert not h.fresh or (not records and cancel is None)


@pytest.mark.parametrize(
    "stored, reason",
    [
        (codec.encode(Cancelled(attempt=0, reason="changed my mind")), "changed my mind"),
        (codec.encode(_DONE), None),  # a result forged where cancels go is still only a cancel
        (codec.encode(Claim(attempt=9, worker="ghost", at=0)), None),
        (codec.encode(step(1, 1, 5)), None),
        (b"\xff\x00garbage", None),
        (b"", None),
    ],
)
def test_whatever_is_stored_as_a_durable_cancel_only_cancels(stored, reason):
    cancel = read_cancel(stored)
    assert isinstance(cancel, Cancelled) and cancel.reason == reason
    assert with_cancel(analyze([]), cancel).cancelled == cancel


def test_choices_are_kept_apart():
    h = analyze([Claim(attempt=1, worker="a", at=0), step(1, 1, 1, index=0), step(1, 2, 2, index=1)])
    assert h.tokens(2) == [[1], [2]]


def test_the_next_attempt_numbers_itself_above_every_claim():
    """A broker restored from disk may deliver a running job again as delivery 1; the log keeps count."""
    h = analyze([Claim(attempt=1, worker="a", at=0), Claim(attempt=3, worker="b", at=1), step(3, 1, 7)])
    assert h.last_attempt == 3
    assert analyze([]).last_attempt == 0


def test_the_owner_is_the_newest_claim_until_it_ends_or_hands_back():
    assert analyze([Claim(attempt=1, worker="a", at=0), Claim(attempt=2, worker="b", at=1)]).owner == "b"
    assert analyze([Claim(attempt=1, worker="a", at=0), Handoff(attempt=1, reason="draining")]).owner is None
    assert analyze([Claim(attempt=1, worker="a", at=0), Result(attempt=1)]).owner is None


def test_delivered_log_probabilities_are_kept_per_choice_with_where_each_frame_began():
    """What a migrated request's Result holds of the frames earlier attempts sent."""

    def frame(seq: int, index: int, tokens: list[int], text: str, top: bool = True) -> Step:
        lps = [-1.0 * t for t in tokens]
        tops = [{t: -1.0 * t} for t in tokens] if top else None
        return Step(
            attempt=1,
            frame=TokensFrame(
                seq=seq, index=index, token_ids=tokens, text=text, logprobs=lps, top_logprobs=tops
            ),
        )

    h = analyze(
        [
            Claim(attempt=1, worker="a", at=0),
            frame(1, 0, [1, 2], "ab"),
            frame(2, 1, [5], "x", top=False),
            frame(3, 0, [3], "cde"),
        ]
    )
    first, second = h.logprobs(2)
    assert (first.logprobs, first.text_offsets) == ([-1.0, -2.0, -3.0], [0, 0, 2])
    assert first.top_logprobs == [{1: -1.0}, {2: -2.0}, {3: -3.0}]
    assert (second.logprobs, second.top_logprobs, second.text_offsets) == ([-5.0], [{}], [0])


def _result(tokens: int, logprobs: bool) -> Result:
    final = FinalFrame(
        seq=tokens + 1,
        request_id="r",
        choices=[Choice(index=0, finish_reason="length", completion_tokens=tokens)],
        usage=Usage(prompt_tokens=1, completion_tokens=tokens),
    )
    kept = ChoiceLogprobs(
        logprobs=[-1.5] * tokens,
        top_logprobs=[{i: -1.5 for i in range(20)}] * tokens,
        text_offsets=[0] * tokens,
    )
    return Result(attempt=1, final=final, token_ids=[[7] * tokens], logprobs=[kept] if logprobs else None)


@pytest.mark.parametrize(
    ("tokens", "logprobs", "limit", "kept"),
    [
        (10, True, 1 << 20, True),
        (10, False, 100, True),  # without log-probabilities the Result is stored as it is
        (5000, True, 1 << 20, False),  # top-20 log-probabilities of 5000 tokens: over a 1 MiB message
    ],
)
def test_a_result_too_large_for_its_log_probabilities_is_stored_as_an_error_naming_them(
    tokens, logprobs, limit, kept
):
    result = _result(tokens, logprobs)
    stored = fitted(result, limit)
    if kept:
        assert stored is result
    else:
        assert stored.final is None and stored.error.code == ErrorCode.PAYLOAD_TOO_LARGE
        assert (
            stored.error.field == "$.output.logprobs"
            and "fewer top log-probabilities" in stored.error.message
        )
        assert len(codec.encode(stored)) < limit
