"""A bucket's keys as they are now, read with a watch, and where that snapshot ends.

nats-py's watcher signals the end of the snapshot with a `None` marker, decided by comparing the
server's count of pending entries with what its reader has taken so far; the server's answer can
overtake entries it had already sent, so the marker can come first (a live worker's model card
once looked absent in CI). The snapshot here ends at the entry the server counts as its last
(`delta` 0, a deleted key's included); a marker before any entry ends it only when the bucket
holds no such key at all.
"""

from __future__ import annotations

import nats.errors
from nats.js.kv import KeyValue


class SnapshotEnd:
    """Whether a watch has delivered the keys that were there when it started."""

    __slots__ = ("marked", "seen")

    def __init__(self) -> None:
        self.seen = False
        self.marked = False

    def entry(self, entry: KeyValue.Entry) -> bool:
        """An entry arrived; True when it was the snapshot's last."""
        self.seen = True
        return entry.delta == 0

    async def marker(self, kv: KeyValue, pattern: str) -> bool:
        """nats-py's end marker arrived; True when the snapshot really is over."""
        self.marked = True
        return self.seen or not await any_stored(kv, pattern)

    def quiet(self) -> bool:
        """Nothing arrived for a while; True when that ends the snapshot: after the marker, what
        was stored was a record nats-py skips (a marker reason it does not know)."""
        return self.marked


async def any_stored(kv: KeyValue, pattern: str) -> bool:
    # nats-py keeps a bucket's stream and subject prefix private; its key_value() made them
    info = await kv._js.stream_info(kv._stream, subjects_filter=f"{kv._pre}{pattern}")
    return bool(info.state.subjects)


async def entries_matching(kv: KeyValue, pattern: str, *, meta_only: bool = False) -> list[KeyValue.Entry]:
    """The keys matching a subject pattern (`i.*`) as they are now, with their values unless
    `meta_only`; deleted keys left out. nats-py's `keys(filters=...)` matches substrings, so `i.*`
    would find nothing; a filtered watch asks the server instead."""
    watcher = await kv.watch(pattern, meta_only=meta_only)
    end = SnapshotEnd()
    found: list[KeyValue.Entry] = []
    try:
        while True:
            try:
                entry = await watcher.updates(timeout=5.0)
            except nats.errors.TimeoutError:
                if end.quiet():
                    break
                raise
            if entry is None:
                if await end.marker(kv, pattern):
                    break
                continue
            if entry.operation is None:
                found.append(entry)
            if end.entry(entry):
                break
    finally:
        await watcher.stop()
    return found
