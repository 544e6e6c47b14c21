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


# -- cancellations no scope asked for ------------------------------------------------------------


async def _await_cancelled_future(after: float = 0.01) -> None:
    """What a library does to a task that awaits one of its futures: cancels the future."""
    import asyncio

    fut = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(after, fut.cancel)
    await fut


async def test_a_child_a_library_cancelled_fails_visibly_instead_of_ending_its_siblings():
    from jetllm.aio import StrayCancellation, task_group

    sibling_ran_on = anyio.Event()

    async def sibling() -> None:
        await anyio.sleep(0.1)
        sibling_ran_on.set()

    with pytest.raises(BaseExceptionGroup) as caught:
        async with task_group() as tg:
            tg.start_soon(sibling)
            tg.start_soon(_await_cancelled_future, 0.2)
    assert sibling_ran_on.is_set()  # the group was not cancelled before the stray came
    (stray,) = caught.value.exceptions
    assert isinstance(stray, StrayCancellation) and "_await_cancelled_future" in str(stray)


async def test_the_owners_cancellations_pass_as_they_always_did():
    from jetllm.aio import task_group

    async def sleeps() -> None:
        await anyio.sleep(10)

    async def times_out() -> None:
        with anyio.move_on_after(0.01):
            await anyio.sleep(10)

    with anyio.fail_after(5):
        async with task_group() as tg:
            tg.start_soon(times_out)  # its own scope: ends normally
            tg.start_soon(sleeps)
            await anyio.sleep(0.05)
            tg.cancel_scope.cancel()  # the group's: every child ends, nothing is raised
    assert tg.cancel_scope.cancelled_caught


async def test_contained_and_supervised_treat_a_stray_cancellation_as_a_failure(caplog):
    from jetllm.aio import contained, supervised

    await contained("a step", _await_cancelled_future)
    assert "a step failed" in caplog.text and "StrayCancellation" in caplog.text

    calls = []

    async def service() -> None:
        calls.append(1)
        if len(calls) == 1:
            await _await_cancelled_future()

    with anyio.fail_after(5):
        await supervised("a service", service, restart_after=0.01)
    assert len(calls) == 2  # started again, as after any failure


async def test_a_task_cancelled_itself_still_ends_cancelled_behind_contained(caplog):
    """nats-py ends a subscription's callback task with Task.cancel() when it unsubscribes."""
    import asyncio

    from jetllm.aio import contained

    started = asyncio.Event()

    async def handler() -> None:
        started.set()
        await asyncio.sleep(10)

    task = asyncio.create_task(contained("a handler", handler))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "failed" not in caplog.text


async def test_entered_takes_its_own_cancellation_even_when_a_library_re_raised_it_unmarked():
    import asyncio

    from jetllm.aio import entered

    scope = anyio.CancelScope()
    with anyio.fail_after(5):
        with entered(scope):
            scope.cancel()
            lost = False
            try:
                await anyio.sleep(10)
            except anyio.get_cancelled_exc_class():
                lost = True
            if lost:
                raise asyncio.CancelledError()  # a new one, as asyncio.gather raises it
    assert scope.cancel_called  # and we got here: the scope ended as a cancelled scope does


async def test_entered_passes_on_a_cancellation_it_does_not_own():
    import asyncio

    from jetllm.aio import entered

    reached = []
    with anyio.CancelScope() as outer:  # a scope around it, cancelled too
        with entered(anyio.CancelScope()) as inner:
            inner.cancel()
            outer.cancel()
            await anyio.sleep(10)
        reached.append("after the inner scope")
    assert not reached and outer.cancelled_caught

    async def cancelled_besides() -> None:  # the task itself, cancelled while the scope was
        with entered(anyio.CancelScope()) as scope:
            scope.cancel()
            asyncio.current_task().cancel()
            await asyncio.sleep(10)
        reached.append("after the scope")

    task = asyncio.create_task(cancelled_besides())
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not reached


async def _reraised_unmarked(seconds: float) -> None:
    """What asyncio.gather in vLLM's prompt rendering does to a cancellation: a new one, whose
    context does not lead back to anyio's."""
    import asyncio

    lost = False
    try:
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        lost = True
    if lost:
        raise asyncio.CancelledError()


@pytest.mark.parametrize(
    ("body", "raised"),
    [
        (lambda: anyio.sleep(10), TimeoutError),  # anyio's own mark
        (lambda: _reraised_unmarked(10), TimeoutError),  # the mark lost on the way
        (lambda: anyio.sleep(0), None),  # done in time
    ],
)
async def test_fail_after_times_out_whatever_became_of_its_cancellation(body, raised):
    from jetllm.aio import fail_after

    try:
        with fail_after(0.05):
            await body()
    except Exception as exc:
        assert type(exc) is raised
    else:
        assert raised is None


async def test_fail_after_passes_on_a_cancellation_from_a_scope_around_it():
    from jetllm.aio import entered, fail_after

    reached = []
    with entered(anyio.CancelScope()) as outer:
        with fail_after(5):
            outer.cancel()
            await _reraised_unmarked(10)
        reached.append("after fail_after")
    assert not reached and outer.cancel_called
