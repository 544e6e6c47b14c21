"""What every part of a worker may know about the worker: its connection, names, identity, queue
policy and counters. Frozen, and built once by the composition root (runtime.py), so a part gets
these facts without getting the worker, and cannot change who the worker is."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.js.client import JetStreamContext

from ..subjects.names import Names
from ..subjects.policy import QueuePolicy


class Counters:
    """What happened to the jobs of this worker; read by the status reply and the metrics endpoint.

    Attributes, not a dict of strings: a misspelt counter is an AttributeError at once, and
    incrementing one costs no hashing on the job path.
    """

    __slots__ = (
        "pulled",
        "acked",
        "completed",
        "deferred",
        "resumed",
        "handed_back",
        "dead_lettered",
        "cancelled",
        "superseded",
        "duplicates",
        "frames_sent",
        "lora_loads",
        "directed",
        "moved",
    )

    def __init__(self) -> None:
        self.pulled = 0
        self.acked = 0
        self.completed = 0
        self.deferred = 0
        self.resumed = 0
        self.handed_back = 0
        self.dead_lettered = 0
        self.cancelled = 0
        self.superseded = 0
        self.duplicates = 0
        self.frames_sent = 0
        self.lora_loads = 0
        """Adapters loaded into the engine (idempotent loads do not count)."""
        self.directed = 0
        """Jobs pulled from this instance's directed queue (also counted in `pulled`)."""
        self.moved = 0
        """Directed jobs this worker moved to the shared queue: its own when it stopped or slept,
        a gone instance's when it swept."""

    def items(self) -> Iterator[tuple[str, int]]:
        for name in self.__slots__:
            yield name, getattr(self, name)


@dataclass(frozen=True, slots=True)
class WorkerContext:
    nc: NATS
    js: JetStreamContext
    names: Names
    instance: str
    model: str
    """The name jobs use for the served model."""
    policy: QueuePolicy
    counters: Counters
    errors: collections.Counter[str]
    """Error frames sent, by error code."""
    prefills: collections.Counter[str] = field(default_factory=collections.Counter)
    """Prompts of a decode worker by where they were prefilled: `remote`, or `local_<why>`."""
