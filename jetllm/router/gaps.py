"""What a KV-event batch means for an instance's block set, given the last seq applied: pure."""

from __future__ import annotations

from enum import Enum

from ..schemas import KvEventBatch


class SeqCheck(Enum):
    APPLY = "apply"
    """The next batch, or the start of a snapshot (a snapshot replaces whatever came before)."""
    STALE = "stale"
    """Seen already (a redelivery): skip."""
    GAP = "gap"
    """Batches are missing before this one: the set is unknown until the next snapshot."""
    UNKNOWN_START = "unknown-start"
    """The first batch seen of this instance, mid-history (older batches expired from the stream)."""


def check_seq(last: int | None, batch: KvEventBatch) -> SeqCheck:
    starts_snapshot = batch.resync is not None and batch.resync.part == 1
    if last is not None and batch.seq <= last:
        return SeqCheck.STALE
    if starts_snapshot or batch.seq == 1 or (last is not None and batch.seq == last + 1):
        return SeqCheck.APPLY
    return SeqCheck.GAP if last is not None else SeqCheck.UNKNOWN_START
