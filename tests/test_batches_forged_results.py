"""A batch line's output is built from the Result in its request log, and the log is outside input:
whoever may publish to it can store any Result. One that does not fit the line's request (more
choices than it asked for, per-choice lists of unequal length, a final frame that misses a choice
or names one twice) is that line's error, a 500 `internal` saying what does not fit, in the
batch's error file; the other lines are written as ever, and the runner goes on."""

from __future__ import annotations

import json

import pytest

from jetllm.batches.lines import InputLine
from jetllm.batches.output import output_lines
from jetllm.openai import stored
from jetllm.openai.endpoints import CHAT, COMPLETIONS, prepare
from jetllm.schemas import Choice, ChoiceLogprobs, ErrorCode, ErrorFrame, FinalFrame, Result, Usage

USER = [{"role": "user", "content": "hi"}]


def result(
    token_ids: list[list[int]],
    text: list[str] | None,
    *indexes: int,
    logprobs: list[ChoiceLogprobs] | None = None,
) -> Result:
    final = FinalFrame(
        seq=9,
        request_id="r",
        choices=[Choice(index=i, finish_reason="length", completion_tokens=1) for i in indexes],
        usage=Usage(prompt_tokens=3, completion_tokens=len(indexes)),
    )
    return Result(attempt=1, final=final, token_ids=token_ids, text=text, logprobs=logprobs)


def kept(n: int) -> ChoiceLogprobs:
    return ChoiceLogprobs(logprobs=[-0.5] * n, top_logprobs=[{5: -0.5}] * n, text_offsets=[0] * n)


FORGED = [
    pytest.param(
        {"messages": USER},
        result([[5], [6]], ["a", "b"], 0, 1),
        "the output of 2 choices; the request has 1",
        id="more choices than the request has",
    ),
    pytest.param(
        {"prompt": "x"},
        result([[5]], ["a"], 0, 1),
        "names choice 1",
        id="a final frame naming a choice the request lacks",
    ),
    pytest.param(
        {"messages": USER, "n": 2, "temperature": 1},
        result([[5], [6]], ["a"], 0, 1),
        "1 entries of text for 2 choices",
        id="text for fewer choices than token_ids",
    ),
    pytest.param(
        {"prompt": "x", "n": 2, "temperature": 1, "logprobs": 1},
        result([[5], [6]], ["a", "b"], 0, 1, logprobs=[kept(1)]),
        "1 entries of logprobs for 2 choices",
        id="logprobs for fewer choices than token_ids",
    ),
    pytest.param(
        {"messages": USER, "n": 2, "temperature": 1},
        result([[5]], ["a"], 0, 1),
        "the output of 1 choices; the request has 2",
        id="token_ids for fewer choices than the request has",
    ),
    pytest.param(
        {"messages": USER, "n": 2, "temperature": 1},
        result([[5], [6]], ["a", "b"], 0, 0),
        "lacks choice 1",
        id="a final frame naming a choice twice",
    ),
    pytest.param(
        {"messages": USER, "n": 2, "temperature": 1},
        result([[5], [6]], ["a", "b"], 0, -1),
        "names choice -1",
        id="a final frame naming a negative choice",
    ),
]


def endpoint_of(body: dict) -> str:
    return CHAT if "messages" in body else COMPLETIONS


@pytest.mark.parametrize("body, forged, says", FORGED)
def test_a_stored_result_that_does_not_fit_its_request_answers_a_500_saying_what(body, forged, says):
    prepared = prepare(endpoint_of(body), {"model": "m", **body}, "batch-1-1")
    status, answer = stored.response(prepared, forged, 1)
    assert status == 500, answer
    error = answer["error"]
    assert (error["type"], error["code"]) == ("server_error", ErrorCode.INTERNAL.value), error
    assert error["message"].startswith("batch-1-1: ") and says in error["message"], error


@pytest.mark.parametrize(
    "body, fits",
    [
        pytest.param({"messages": USER}, result([[5]], ["a"], 0), id="one choice"),
        pytest.param(
            {"prompt": "x", "n": 2, "temperature": 1, "logprobs": 1},
            result([[5], [6, 7]], ["a", "bc"], 1, 0, logprobs=[kept(1), kept(2)]),
            id="two choices, final frame in any order",
        ),
        pytest.param({"messages": USER}, result([[5]], None, 0), id="no text"),
    ],
)
def test_a_stored_result_that_fits_is_answered_as_ever(body, fits):
    prepared = prepare(endpoint_of(body), {"model": "m", **body}, "batch-1-1")
    status, answer = stored.response(prepared, fits, 1)
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == list(range(len(fits.token_ids)))


def test_a_forged_result_is_its_lines_error_and_the_batch_goes_on():
    lines = [
        InputLine(1, "good", {"model": "m", "messages": USER}),
        InputLine(2, "more-choices", {"model": "m", "messages": USER}),
        InputLine(3, "short-text", {"model": "m", "messages": USER, "n": 2, "temperature": 1}),
        InputLine(4, "failed", {"model": "m", "messages": USER}),
        InputLine(5, "good-too", {"model": "m", "messages": USER, "n": 2, "temperature": 1}),
        InputLine(6, "unrun", {"model": "m", "messages": USER}),
    ]
    error = ErrorFrame(seq=1, request_id="r", code=ErrorCode.ENGINE_ERROR, message="boom")
    outcomes = {
        1: result([[5]], ["hello"], 0),
        2: result([[5], [6]], ["a", "b"], 0, 1),
        3: result([[5], [6]], ["a"], 0, 1),
        4: Result(attempt=1, error=error),
        5: result([[5], [6]], ["x", "y"], 0, 1),
    }
    out, errors = output_lines("batch_abc", lines, outcomes, CHAT, "done")
    written = [json.loads(line) for line in out]
    failed = {e["custom_id"]: e for e in map(json.loads, errors)}
    assert [w["custom_id"] for w in written] == ["good", "good-too"]
    assert written[0]["response"]["body"]["choices"][0]["message"]["content"] == "hello"
    assert list(failed) == ["more-choices", "short-text", "failed", "unrun"]
    for custom_id, says in (("more-choices", "output of 2 choices"), ("short-text", "1 entries of text")):
        response = failed[custom_id]["response"]
        assert response["status_code"] == 500, response
        assert (
            response["body"]["error"]["code"] == "internal" and says in response["body"]["error"]["message"]
        )
    assert failed["failed"]["response"]["body"]["error"]["message"] == "boom"
    assert failed["unrun"]["error"]["code"] == "batch_failed"
