"""How a worker's slots are shared between its directed queue and its other queues: pure rules.

Directed jobs go first: while some are known to wait, the other queues hold no credit for the
slots they need (a puller holding such credit gives it up at once), and the directed puller asks
for no more than wait. Nothing is pulled that the worker cannot start: the directed puller's
credit and the others' never add up to more than the free slots.

Whether directed jobs wait is counted (`Waiting`) rather than asked, so that an idle worker's
shared queue keeps its long pulls: every directed publish is heard on the directed subject (one
more), every delivery takes one, a directed pull that ends unfilled says there are none, and the
consumer's own count (read every sweep) corrects a publish that was not heard.
"""

from __future__ import annotations


class Waiting:
    """Directed jobs believed to wait in this worker's directed queue."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def heard(self) -> None:
        self.count += 1

    def delivered(self) -> None:
        self.count = max(self.count - 1, 0)

    def empty(self) -> None:
        self.count = 0

    def reported(self, pending: int) -> None:
        """The consumer says `pending` jobs wait (or wait for redelivery)."""
        self.count = max(self.count, pending)


def directed_allowance(free: int, waiting: int, others: int) -> int:
    """Credit the directed puller may hold: as many jobs as wait, in free slots no other queue
    holds credit for (`others`: the most any one other puller holds)."""
    return max(min(waiting, free - others), 0)


def shared_allowance(free: int, waiting: int, directed: int) -> int:
    """Credit another queue's puller may hold: the free slots that neither the directed queue's
    credit nor its waiting jobs claim."""
    return max(free - max(waiting, directed), 0)


def shard_kept(beyond: int, paused: bool, directed_short: bool) -> int:
    """Shard credit the shard puller may keep, and take a shard into: one, unless the worker holds
    a shard's requests beyond its slots already (`beyond`; they wait in the engine's queue), is
    paused, or directed jobs wait for every free slot (`directed_short`). A full worker keeps it:
    were it dropped whenever the last slot is taken, a fully loaded worker would cancel and renew
    a pull (a new inbox and a round trip) for each online job it takes. A shard's requests beyond
    the free slots wait in the engine's own queue and start the moment a running request ends (as
    offline inference keeps its queue full), which bounds what a worker holds beyond its slots by
    one shard (`shard_room`)."""
    return 0 if beyond > 0 or paused or directed_short else 1


def shard_allowance(free: int, beyond: int, paused: bool, directed_short: bool) -> int:
    """Shard credit the shard puller may ask for: what it may keep, but only while a slot is free.
    A full worker lets its pull run out (`expires`) rather than renew it, so the shards go to the
    workers with room first; one that comes meanwhile is still taken."""
    return shard_kept(beyond, paused, directed_short) if free > 0 else 0


def must_cancel(outstanding: int, allowance: int, directed_waiting: bool) -> bool:
    """Whether a puller drops its credit now: it holds some but may hold none (paused, or the
    slots went to another queue), or directed jobs wait for slots it holds."""
    return outstanding > 0 and (allowance <= 0 or (directed_waiting and outstanding > allowance))
