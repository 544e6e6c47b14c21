"""The slots: the free-slot rule every puller asks, who is told when it changes, waiting for idle."""

from __future__ import annotations

import anyio
import pytest

from jetllm.workers.slots import Slots

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("total", "busy", "paused", "free"),
    [
        (4, 0, False, 4),
        (4, 3, False, 1),
        (4, 4, False, 0),
        (4, 0, True, 0),  # a pause frees nothing, whatever the count
        (4, 2, True, 0),
        (1, 0, False, 1),
    ],
)
def test_free_slots(total, busy, paused, free):
    slots = Slots(total)
    for _ in range(busy):
        slots.take()
    slots.pause(paused)
    assert slots.free() == free


def test_listeners_hear_a_freed_slot_and_a_pause_but_not_a_taken_slot():
    slots = Slots(2)
    heard: list[int] = []
    slots.listen(lambda: heard.append(slots.free()))
    slots.take()
    assert heard == []
    slots.release()
    slots.pause(True)
    slots.pause(False)
    assert heard == [2, 0, 2]


async def test_wait_idle_returns_once_the_last_job_is_settled():
    slots = Slots(2)
    slots.take()
    slots.take()
    handed: list[bool] = []
    async with anyio.create_task_group() as tg:

        async def settle() -> None:
            await anyio.sleep(0.05)
            slots.release()
            await anyio.sleep(0.05)
            slots.release()

        tg.start_soon(settle)
        with anyio.fail_after(5):
            await slots.wait_idle(10.0, lambda: handed.append(True))
    assert slots.busy == 0 and handed == [True]  # asked to hand back what was left: nothing


async def test_jobs_still_running_after_the_grace_are_handed_back_and_waited_for():
    slots = Slots(1)
    slots.take()

    def hand_back() -> None:  # a handed-back job settles soon after
        async def settle() -> None:
            await anyio.sleep(0.05)
            slots.release()

        tg.start_soon(settle)

    async with anyio.create_task_group() as tg:
        with anyio.fail_after(5):
            await slots.wait_idle(0.1, hand_back)
        assert slots.busy == 0


async def test_a_sleep_and_a_drain_waiting_for_idle_together_both_wake():
    slots = Slots(1)
    slots.take()
    woke: list[str] = []

    async def wait(who: str) -> None:
        await slots.wait_idle(10.0, lambda: None)
        woke.append(who)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, "sleep")
            tg.start_soon(wait, "drain")
            await anyio.sleep(0.05)
            slots.release()
    assert sorted(woke) == ["drain", "sleep"]
