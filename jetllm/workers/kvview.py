"""The relay's own view of an engine rank's cached blocks, built from the events it saw (what a
resync sends, since vLLM cannot be asked for its block set), and events cut into groups that fit
one message. Pure: kvevents.py publishes what these compute."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

from ..schemas import KvCleared, KvEvent, KvRemoved, KvStored


class _Block:
    __slots__ = ("parent", "tokens", "lora", "medium")

    def __init__(self, parent: int | None, tokens: array, lora: str | None, medium: str | None) -> None:
        self.parent = parent
        self.tokens = tokens
        self.lora = lora
        self.medium = medium


class BlockSet:
    """The blocks of one rank as the events describe them, in the order they were stored."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[str | None, int], _Block] = {}

    def apply(self, events: list[KvEvent]) -> None:
        for ev in events:
            if isinstance(ev, KvStored):
                parent = ev.parent_block_hash
                size = ev.block_size
                for i, h in enumerate(ev.block_hashes):
                    key = (ev.medium, h)
                    self.blocks.pop(key, None)
                    self.blocks[key] = _Block(
                        parent, array("q", ev.token_ids[i * size : (i + 1) * size]), ev.lora_name, ev.medium
                    )
                    parent = h
            elif isinstance(ev, KvRemoved):
                for h in ev.block_hashes:
                    self.blocks.pop((ev.medium, h), None)
            else:
                self.blocks.clear()

    def as_events(self) -> list[KvEvent]:
        """A KvCleared, then the blocks as chains of stored events (a child after its parent)."""
        out: list[KvEvent] = [KvCleared()]
        chain: KvStored | None = None
        for (medium, h), b in self.blocks.items():
            size = len(b.tokens)
            if (
                chain is not None
                and b.parent == chain.block_hashes[-1]
                and chain.medium == medium
                and chain.lora_name == b.lora
                and chain.block_size == size
            ):
                chain.block_hashes.append(h)
                chain.token_ids.extend(b.tokens)
            else:
                chain = KvStored(
                    block_hashes=[h],
                    parent_block_hash=b.parent,
                    token_ids=list(b.tokens),
                    block_size=size,
                    lora_name=b.lora,
                    medium=medium,
                )
                out.append(chain)
        return out


def _size(ev: KvEvent) -> int:
    """An upper bound of the event's msgpack size (token ids < 2**32)."""
    if isinstance(ev, KvStored):
        return 96 + 9 * len(ev.block_hashes) + 5 * len(ev.token_ids) + len(ev.lora_name or "")
    if isinstance(ev, KvRemoved):
        return 48 + 9 * len(ev.block_hashes)
    return 24


def _split_stored(ev: KvStored, limit: int) -> Iterator[KvStored]:
    per = max(1, (limit - 96) // (9 + 5 * max(1, ev.block_size)))
    parent = ev.parent_block_hash
    for i in range(0, len(ev.block_hashes), per):
        hashes = ev.block_hashes[i : i + per]
        yield KvStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=ev.token_ids[i * ev.block_size : (i + len(hashes)) * ev.block_size],
            block_size=ev.block_size,
            lora_name=ev.lora_name,
            medium=ev.medium,
        )
        parent = hashes[-1]


def chunks(events: list[KvEvent], limit: int) -> list[list[KvEvent]]:
    """The events in order, in groups whose encoding stays under `limit` bytes (NATS max_payload)."""
    out: list[list[KvEvent]] = [[]]
    used = 0
    for ev in events:
        parts: Any = [ev]
        if _size(ev) > limit and isinstance(ev, KvStored):
            parts = _split_stored(ev, limit)
        for part in parts:
            size = _size(part)
            if out[-1] and used + size > limit:
                out.append([])
                used = 0
            out[-1].append(part)
            used += size
    return out
