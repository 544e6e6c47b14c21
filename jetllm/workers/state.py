"""The worker's state: one machine, moved only by the events in a small table.

Before this, a worker kept a state string beside `sleeping`, `ready` and a pause flag, folded them
into the registry's state in one function, and reported a different vocabulary in its status
reply. Now the state is one value, every change is an event looked up in `TRANSITIONS` (a pair
that is not there is a bug, raised as such), and what the fleet sees (`InstanceState`, `ready`) is
a pure projection of it. Pausing pulls is not a state: it belongs to the slots (slots.py), as a
sleep pauses before it is asleep and a drain never pauses.
"""

from __future__ import annotations

import logging
from typing import Literal

import anyio

from ..schemas import InstanceState
from .running import RunningRequests

log = logging.getLogger(__name__)

WorkerState = Literal["starting", "serving", "sleeping", "draining", "stopped", "engine_dead"]
Event = Literal["served", "slept", "woke", "drain", "engine_died", "stopped"]

STATES: tuple[WorkerState, ...] = ("starting", "serving", "sleeping", "draining", "stopped", "engine_dead")
EVENTS: tuple[Event, ...] = ("served", "slept", "woke", "drain", "engine_died", "stopped")

TRANSITIONS: dict[tuple[WorkerState, Event], WorkerState] = {
    ("starting", "served"): "serving",
    ("starting", "engine_died"): "engine_dead",
    ("starting", "stopped"): "stopped",
    ("serving", "slept"): "sleeping",
    ("serving", "drain"): "draining",
    ("serving", "engine_died"): "engine_dead",
    ("serving", "stopped"): "stopped",  # a crash after serving
    ("sleeping", "woke"): "serving",
    ("sleeping", "drain"): "draining",
    ("sleeping", "engine_died"): "engine_dead",
    ("sleeping", "stopped"): "stopped",
    ("draining", "slept"): "draining",  # a sleep or a wake that was under way when the drain began
    ("draining", "woke"): "draining",
    ("draining", "engine_died"): "engine_dead",
    ("draining", "stopped"): "stopped",
    # A dead engine stays the reason to the end, whatever the serve loop still goes through.
    ("engine_dead", "served"): "engine_dead",
    ("engine_dead", "slept"): "engine_dead",
    ("engine_dead", "woke"): "engine_dead",
    ("engine_dead", "engine_died"): "engine_dead",
    ("engine_dead", "stopped"): "engine_dead",
    ("stopped", "engine_died"): "stopped",
}

EXIT_OK = 0
EXIT_ENGINE_DEAD = 3
EXIT_CRASHED = 4


class InvalidTransition(RuntimeError):
    """An event the worker's state cannot take: a bug in the runtime, never a message's doing."""


def next_state(state: WorkerState, event: Event) -> WorkerState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(f"worker state {state!r} has no transition for {event!r}") from None


def public(state: WorkerState) -> InstanceState:
    """What the registry, load reports and control replies show: a worker on its way out is draining."""
    if state in ("starting", "serving", "sleeping"):
        return state  # type: ignore[return-value]  # narrowed by the test above
    return "draining"


def takes_jobs(state: WorkerState) -> bool:
    """The registry's `ready`: consumer bound, engine answered, awake, not leaving."""
    return state == "serving"


class Lifecycle:
    """The worker's state, and why and how its process ends (exit code, stop reason)."""

    def __init__(self, running: RunningRequests) -> None:
        self._running = running
        self.state: WorkerState = "starting"
        self.exit_code = EXIT_OK
        self.stop_reason = "stop requested"
        self.stop_requested = anyio.Event()

    def advance(self, event: Event) -> WorkerState:
        self.state = next_state(self.state, event)
        return self.state

    def public(self) -> InstanceState:
        return public(self.state)

    @property
    def ready(self) -> bool:
        return takes_jobs(self.state)

    @property
    def engine_dead(self) -> bool:
        return self.state == "engine_dead"

    def stop(self, reason: str = "stop requested") -> None:
        """Begin a graceful stop: no more pulls, running requests get the grace period."""
        if not self.stop_requested.is_set():
            self.stop_reason = reason
        self.stop_requested.set()

    def engine_died(self, why: str) -> None:
        """Stop pulling, hand back every running job, exit with EXIT_ENGINE_DEAD (once)."""
        if self.state in ("engine_dead", "stopped"):
            return
        log.error("engine is dead (%s): handing back %d jobs and exiting", why, len(self._running))
        self.advance("engine_died")
        self.exit_code = EXIT_ENGINE_DEAD
        self._running.hand_back_all()
        self.stop(f"engine dead: {why}")
