"""The worker's state machine: every (state, event) pair, and what the fleet sees of each state."""

from __future__ import annotations

import pytest

from jetllm.workers.running import RunningRequests
from jetllm.workers.state import (
    EVENTS,
    EXIT_ENGINE_DEAD,
    EXIT_OK,
    STATES,
    InvalidTransition,
    Lifecycle,
    next_state,
    public,
    takes_jobs,
)

X = None  # no such transition: a bug in the runtime
# Rows: the state; columns: served, slept, woke, drain, engine_died, stopped.
# fmt: off
TABLE = {
    "starting":    ("serving",     X,             X,             X,          "engine_dead", "stopped"),
    "serving":     (X,             "sleeping",    X,             "draining", "engine_dead", "stopped"),
    "sleeping":    (X,             X,             "serving",     "draining", "engine_dead", "stopped"),
    "draining":    (X,             "draining",    "draining",    X,          "engine_dead", "stopped"),
    "stopped":     (X,             X,             X,             X,          "stopped",     X),
    "engine_dead": ("engine_dead", "engine_dead", "engine_dead", X,          "engine_dead", "engine_dead"),
}
# fmt: on
CASES = [(state, event, TABLE[state][i]) for state in STATES for i, event in enumerate(EVENTS)]


def test_the_table_covers_every_state():
    assert set(TABLE) == set(STATES)


@pytest.mark.parametrize(("state", "event", "after"), CASES, ids=[f"{s}-{e}" for s, e, _ in CASES])
def test_transition(state, event, after):
    if after is None:
        with pytest.raises(InvalidTransition, match=f"{state!r} has no transition for {event!r}"):
            next_state(state, event)
    else:
        assert next_state(state, event) == after


@pytest.mark.parametrize(
    ("state", "shown", "ready"),
    [
        ("starting", "starting", False),
        ("serving", "serving", True),
        ("sleeping", "sleeping", False),
        ("draining", "draining", False),
        ("stopped", "draining", False),  # a worker on its way out is draining to the fleet
        ("engine_dead", "draining", False),
    ],
)
def test_what_the_fleet_sees(state, shown, ready):
    assert public(state) == shown and takes_jobs(state) is ready


def test_an_engine_death_hands_back_every_job_stops_once_and_stays_the_reason():
    running = RunningRequests(nc=None)
    handed: list[str] = []

    class Run:
        def __init__(self, rid):
            self.rid, self.hand_back = rid, False
            self.scope = self

        def cancel(self):
            handed.append(self.rid)

    running["a"], running["b"] = Run("a"), Run("b")
    life = Lifecycle(running)
    life.advance("served")
    life.engine_died("boom")
    assert life.state == "engine_dead" and life.exit_code == EXIT_ENGINE_DEAD and handed == ["a", "b"]
    assert life.stop_requested.is_set() and life.stop_reason == "engine dead: boom"
    life.engine_died("again")
    assert handed == ["a", "b"] and life.stop_reason == "engine dead: boom"
    life.advance("stopped")
    assert life.state == "engine_dead" and not life.ready


def test_the_first_stop_reason_is_kept():
    life = Lifecycle(RunningRequests(nc=None))
    life.stop("SIGTERM: drained")
    life.stop("stop requested")
    assert life.stop_reason == "SIGTERM: drained" and life.exit_code == EXIT_OK
