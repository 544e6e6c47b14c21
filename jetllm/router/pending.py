"""Prompts the router has just sent somewhere, before their blocks show up in the KV events: pure.

A prefix's first job takes a prefill's time before its worker reports the blocks stored. Without
this memory, the prefix's next jobs in that window look cold and land anywhere, and each computes
the prefix again. With it they follow the first: its instance counts as holding the blocks until
they are reported (the index then knows) or `ttl` passes (the job failed, or its blocks were
never kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

PENDING_TTL = 10.0
"""Seconds a placement counts as holding its prompt's blocks."""
PENDING_BLOCKS = 200_000
"""Blocks remembered at most (the oldest placements forgotten first)."""


class PendingBlocks:
    def __init__(self, ttl: float = PENDING_TTL, limit: int = PENDING_BLOCKS) -> None:
        self.ttl = ttl
        self.limit = limit
        self._blocks: dict[int, tuple[str, float]] = {}
        """Block id -> (instance it was sent to, when that stops counting)."""

    def __len__(self) -> int:
        return len(self._blocks)

    def note(self, chain: Sequence[int], instance: str, now: float) -> None:
        """`chain`'s blocks were sent to `instance` at `now`."""
        blocks = self._blocks
        blocks.update(zip(chain, repeat((instance, now + self.ttl))))
        if len(blocks) > self.limit:
            self._prune(now)

    def holder(self, chain: Sequence[int], now: float) -> tuple[str, int] | None:
        """The instance `chain`'s first block was last sent to, and how many leading blocks went
        there with it; None if the first block is not pending."""
        blocks = self._blocks
        first = blocks.get(chain[0]) if chain else None
        if first is None or first[1] <= now:
            return None
        instance, n = first[0], 0
        for key in chain:
            got = blocks.get(key)
            if got is None or got[0] != instance or got[1] <= now:
                break
            n += 1
        return instance, n

    def _prune(self, now: float) -> None:
        """Expired blocks go; if that is not enough, the longest noted go until a quarter is free
        (a block noted again keeps its first place: it is dropped early, and noted again soon)."""
        kept = {k: v for k, v in self._blocks.items() if v[1] > now}
        if len(kept) > self.limit:
            kept = dict(list(kept.items())[len(kept) - self.limit * 3 // 4 :])
        self._blocks = kept


TRAFFIC_HALF_LIFE = 30.0
"""Seconds after which a directed job counts half in `RecentJobs`."""


class RecentJobs:
    """Jobs this router directed to each instance lately (each one's weight halving every
    `half_life` seconds). A prefix's jobs follow it, so an instance that has been sent many is
    likely to be sent many more: a new prefix's home goes elsewhere when loads tie."""

    def __init__(self, half_life: float = TRAFFIC_HALF_LIFE) -> None:
        self.half_life = half_life
        self._counts: dict[str, tuple[float, float]] = {}

    def add(self, instance: str, now: float) -> None:
        self._counts[instance] = (self.of(instance, now) + 1.0, now)

    def of(self, instance: str, now: float) -> float:
        got = self._counts.get(instance)
        if got is None:
            return 0.0
        count, at = got
        return count * 0.5 ** ((now - at) / self.half_life)

    def forget(self, instance: str) -> None:
        self._counts.pop(instance, None)
