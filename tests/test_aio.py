"""Retrying a call that fails for a while (a server restarting, a stream leader moving)."""

from __future__ import annotations

import anyio
import pytest

from jetllm.aio import backoff, retried

pytestmark = pytest.mark.anyio


class Flaky:
    """Fails with the given errors, one per call, then answers "ok"."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


async def test_a_call_that_recovers_within_the_time_succeeds():
    call = Flaky(TimeoutError(), ConnectionError())
    assert await retried(call, errors=(TimeoutError, ConnectionError), within=5, what="x", first=0.01) == "ok"
    assert call.calls == 3


async def test_the_last_failure_is_raised_once_the_time_is_up():
    call = Flaky(*[TimeoutError(f"try {i}") for i in range(100)])
    with anyio.fail_after(5):
        with pytest.raises(TimeoutError, match="try [1-9]"):
            await retried(call, errors=(TimeoutError,), within=0.2, what="x", first=0.01, longest=0.05)
    assert 2 < call.calls < 100


async def test_other_failures_are_not_retried():
    call = Flaky(ValueError("bad"))
    with pytest.raises(ValueError, match="bad"):
        await retried(call, errors=(TimeoutError,), within=5, what="x")
    assert call.calls == 1


def test_backoff_doubles_up_to_its_longest_pause():
    from itertools import islice

    assert list(islice(backoff(0.1, 0.5), 5)) == [0.1, 0.2, 0.4, 0.5, 0.5]
