"""When a worker checks its running requests' logs after a reconnect or a leader election."""

from __future__ import annotations

import pytest

from jetllm.workers.recovery import PASSES, due_passes


@pytest.mark.parametrize(
    ("now", "changed", "due", "runs", "left"),
    [
        (10.0, False, [], False, []),  # nothing happened
        (10.0, True, [], True, [12.0, 15.0]),  # noticed: a pass at once, two more later
        (11.0, False, [12.0, 15.0], False, [12.0, 15.0]),
        (12.2, False, [12.0, 15.0], True, [15.0]),
        (15.1, False, [15.0], True, []),
        (13.0, True, [15.0], True, [15.0, 18.0]),  # a new change starts the passes afresh
        (20.0, False, [12.0, 15.0], True, []),  # passes overdue together run once
    ],
)
def test_a_change_is_checked_at_once_and_again_after_the_new_leader_settles(now, changed, due, runs, left):
    assert PASSES == (0.0, 2.0, 5.0)
    assert due_passes(now, changed, due) == (runs, left)
