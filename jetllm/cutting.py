"""Cutting a sequence into consecutive parts bounded by size and by count: the frames of one
engine step into messages (workers/framebatch.py), a batch's lines into shards (batches/plan.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def consecutive(
    items: Sequence[T], sizes: Sequence[int], limit: int, most: int | None = None
) -> list[list[T]]:
    """`items` in order, cut into parts whose `sizes` add up to at most `limit` and that hold at most
    `most` items each; an item larger than `limit` goes alone (whatever it fails at, it fails alone)."""
    parts: list[list[T]] = []
    part: list[T] = []
    used = 0
    for item, size in zip(items, sizes, strict=True):
        if part and (used + size > limit or (most is not None and len(part) >= most)):
            parts.append(part)
            part, used = [], 0
        part.append(item)
        used += size
    if part:
        parts.append(part)
    return parts
