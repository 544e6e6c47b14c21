"""The generate role's pure decisions about continuing a request another worker started."""

from __future__ import annotations

import pytest

from jetllm.errors import RequestRejected
from jetllm.schemas import ErrorCode, StopConditions
from jetllm.workers.requestlog import History
from jetllm.workers.roles.generate.continuation import (
    already_done,
    check_budget,
    check_delivered,
    continued,
    max_tokens,
)

from .jobs import req

EOS = [2]


def stop(**kw) -> object:
    return req("fake", stop=StopConditions(**{"max_tokens": 10, **kw}))


@pytest.mark.parametrize(
    ("request_", "delivered", "text", "budget", "ends"),
    [
        (stop(), [], None, 10, None),
        (stop(), [5, 6], None, 10, None),
        (stop(), [5] * 10, None, 10, ("length", None)),
        (stop(), [5, 2], None, 10, ("stop", None)),  # EOS delivered: the worker died before its final
        (stop(ignore_eos=True), [5, 2], None, 10, None),
        (stop(stop_token_ids=[7]), [5, 7], None, 10, ("stop", 7)),
        (stop(stop_token_ids=[7], min_tokens=3), [5, 7], None, 10, None),  # min_tokens holds stops off
        (stop(stop=["ab"]), [5, 6], "xxab", 10, ("stop", "ab")),
        (stop(stop=["ab"]), [5, 6], None, 10, None),  # no text delivered: stop strings cannot have matched
    ],
)
def test_whether_the_delivered_tokens_already_ended_the_request(request_, delivered, text, budget, ends):
    done = already_done(request_, delivered, text, budget, EOS)
    if ends is None:
        assert done is None
    else:
        assert (done.finish_reason, done.stop_reason, done.completion_tokens) == (*ends, len(delivered))


@pytest.mark.parametrize(
    ("asked", "prompt", "limit", "budget", "field"),
    [
        (None, 10, 256, 246, None),
        (5, 10, 256, 5, None),
        (246, 10, 256, 246, None),
        (247, 10, 256, None, "$.stop.max_tokens"),
        (None, 256, 256, None, "$.prompt"),
    ],
)
def test_the_token_budget(asked, prompt, limit, budget, field):
    r = req("fake", stop=StopConditions(max_tokens=asked))
    if field is None:
        assert max_tokens(r, prompt, limit) == budget
    else:
        with pytest.raises(RequestRejected) as e:
            max_tokens(r, prompt, limit)
        assert e.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED and e.value.field == field


@pytest.mark.parametrize(("deaths", "budget", "refused"), [(0, 0, False), (3, 3, False), (4, 3, True)])
def test_the_migration_budget(deaths, budget, refused):
    history = History(deaths=deaths)
    if refused:
        with pytest.raises(RequestRejected, match=f"died under this request {deaths} times"):
            check_budget(history, budget, attempt=5)
    else:
        check_budget(history, budget, attempt=5)


def test_a_continuation_runs_the_delivered_tokens_as_prompt_with_the_rest_of_the_budget():
    r = req("fake", stop=StopConditions(max_tokens=10, min_tokens=4))
    engine_req, prompt, budget = continued(r, [1, 2, 3], [7, 8], 10)
    assert prompt == [1, 2, 3, 7, 8] and budget == 8
    assert engine_req.stop.max_tokens == 8 and engine_req.stop.min_tokens == 2


@pytest.mark.parametrize(
    ("delivered", "vocab", "bad"),
    [
        ([5, 511], 512, None),
        ([], 512, None),
        ([5, 512], 512, 512),  # a forged log record: the engine would index past its embedding table
        ([-1], 512, -1),
        ([10**9], None, None),  # an engine that does not say its vocabulary: vLLM checks token prompts
    ],
)
def test_delivered_tokens_the_model_cannot_have_produced_end_the_request(delivered, vocab, bad):
    if bad is None:
        check_delivered(delivered, vocab)
        return
    with pytest.raises(RequestRejected) as e:
        check_delivered(delivered, vocab)
    assert e.value.code == ErrorCode.NOT_MIGRATABLE and f"token {bad}" in str(e.value)
