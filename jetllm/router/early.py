"""KV-event batches of instances the registry does not show (yet): held briefly, bounded, pure.

A worker relays its KV events (its start snapshot first) before it writes its registry record, and
the router follows the two on separate subscriptions: a new worker's first batches can reach the
router before its record does. The router keeps index state only for instances the registry
shows, so such batches wait here until the record arrives (then they are applied in order) or
`ttl` passes (then they are dropped). Anyone on the bus can name any instance, so the hold is
bounded in batches and in size (block ids, token ids and names) together, whatever names the
batches carry:
past the bounds the oldest batches go first (the newest are the likeliest to belong to a worker
starting now; on a router's start, the stream's replay brings the history of instances long
gone, oldest first). A dropped batch costs the router nothing lasting:
the instance's next batch shows a seq it cannot place, and the router asks it for a snapshot
(gaps.py, UNKNOWN_START).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container

from ..schemas import KvEventBatch, KvRemoved, KvStored

HOLD_FOR = 10.0
"""Seconds a batch waits for its instance's registry record."""
HOLD_BATCHES = 1024
"""Batches held at most, all instances together."""
HOLD_SIZE = 250_000
"""Size held at most, all batches together (`size`: about 10 MB)."""


def size_of(batch: KvEventBatch) -> int:
    """What holding `batch` costs, in ids: one per block id and token id, one per event and
    batch, one per 8 characters of the names it carries (anyone may send long ones)."""
    chars = len(batch.instance) + len(batch.model)
    n = 1
    for ev in batch.events:
        n += 1
        if isinstance(ev, KvStored):
            n += len(ev.block_hashes) + len(ev.token_ids)
            chars += len(ev.lora_name or "") + len(ev.medium or "")
        elif isinstance(ev, KvRemoved):
            n += len(ev.block_hashes)
            chars += len(ev.medium or "")
    return n + chars // 8


class EarlyBatches:
    def __init__(
        self, ttl: float = HOLD_FOR, max_batches: int = HOLD_BATCHES, max_size: int = HOLD_SIZE
    ) -> None:
        self.ttl = ttl
        self.max_batches = max_batches
        self.max_size = max_size
        self._held: deque[tuple[float, int, KvEventBatch]] = deque()
        """(until when, size, batch), in arrival order."""
        self._per_instance: dict[str, int] = {}
        """Batches held per instance."""
        self.size = 0
        """Size held now."""

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, instance: str) -> bool:
        return instance in self._per_instance

    def instances(self) -> list[str]:
        return list(self._per_instance)

    def hold(self, batch: KvEventBatch, now: float) -> tuple[bool, int]:
        """Keeps `batch` until its instance registers, dropping the batches held past their time
        and, past the bounds, the oldest; returns whether `batch` is held (not when it alone
        exceeds the bounds) and how many batches were dropped."""
        w = size_of(batch)
        if w > self.max_size:
            return False, self.expire(now)
        dropped = self.expire(now)
        held = self._held
        while held and (len(held) >= self.max_batches or self.size + w > self.max_size):
            _, old_w, old = held.popleft()
            self._forget_one(old.instance, old_w)
            dropped += 1
        held.append((now + self.ttl, w, batch))
        self.size += w
        self._per_instance[batch.instance] = self._per_instance.get(batch.instance, 0) + 1
        return True, dropped

    def expire(self, now: float) -> int:
        """Drops the batches held past their time; returns how many."""
        n = 0
        held = self._held
        while held and held[0][0] <= now:
            _, w, batch = held.popleft()
            self._forget_one(batch.instance, w)
            n += 1
        return n

    def take(self, instances: Container[str]) -> list[KvEventBatch]:
        """The batches held for `instances`, in arrival order, no longer held."""
        taken: list[KvEventBatch] = []
        kept: deque[tuple[float, int, KvEventBatch]] = deque()
        for entry in self._held:
            batch = entry[2]
            if batch.instance in instances:
                taken.append(batch)
                self._forget_one(batch.instance, entry[1])
            else:
                kept.append(entry)
        self._held = kept
        return taken

    def _forget_one(self, instance: str, w: int) -> None:
        self.size -= w
        left = self._per_instance[instance] - 1
        if left:
            self._per_instance[instance] = left
        else:
            del self._per_instance[instance]
