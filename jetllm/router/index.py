"""Which instance holds which prefix-cache blocks: the router's index, fed by KV-cache events.

Memory first (1,000 instances x 10,000 blocks must fit well under 1 GB): one dict from a 64-bit
block id to its holders, where a value >= 0 is the single holder's slot (shared int objects) and a
value < 0 is `~mask` of the holders' slots (a block held by several); per slot, an append-only
array of the ids it stored (8 bytes a block) serves a clear or an instance's departure and is
compacted when stale entries pile up. A slot is one (instance, dp_rank): each rank has its own cache.

Base blocks are keyed by the engine's own ids (hashing.py explains why they are comparable);
LoRA blocks by the router's chain hash, with a per-slot map from the engine's id (only LoRA blocks).
Only the engine's own cache tier counts (medium None or "GPU"); offload tiers are ignored.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Iterable, Sequence

from ..schemas import KvCleared, KvEvent, KvRemoved, KvStored
from .hashing import BlockHasher, lora_chain

log = logging.getLogger(__name__)

Slot = tuple[str, int]
"""(instance, dp_rank)."""


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class _SlotState:
    __slots__ = ("key", "log", "held", "lora", "foreign")

    def __init__(self, key: Slot) -> None:
        self.key = key
        self.log = array("Q")
        self.held = 0
        self.lora: dict[int, int] = {}
        self.foreign = False
        """Its root blocks hash differently from ours (another seed or algorithm): ignored."""


class BlockIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._slots: list[_SlotState | None] = []
        self._by_instance: dict[str, dict[int, int]] = {}
        """Instance -> rank -> slot number (an instance's slots without scanning every slot)."""
        self._free: list[int] = []
        self._ints: list[int] = []
        """One int object per slot number, shared by every single-holder entry."""
        self.bad_events = 0
        """Events skipped because they could not be applied (a block size of 0, a negative hash)."""

    # bookkeeping

    def slot(self, instance: str, rank: int = 0) -> int:
        """The slot of (instance, rank), made on first use: the caller decides which are real
        (the router only asks for ranks of instances the registry shows)."""
        ranks = self._by_instance.get(instance)
        n = ranks.get(rank) if ranks is not None else None
        if n is None:
            if self._free:
                n = self._free.pop()
            else:
                n = len(self._slots)
                self._slots.append(None)
                self._ints.append(n)
            self._slots[n] = _SlotState((instance, rank))
            self._by_instance.setdefault(instance, {})[rank] = n
        return n

    def slots_of(self, instance: str) -> list[int]:
        return list(self._by_instance.get(instance, {}).values())

    @property
    def slots(self) -> int:
        """Slots in use: (instance, rank) pairs the index keeps."""
        return len(self._slots) - len(self._free)

    def instance_of(self, slot: int) -> str:
        state = self._slots[slot]
        assert state is not None
        return state.key[0]

    def held(self, instance: str) -> int:
        return sum(self._state(n).held for n in self.slots_of(instance))

    @property
    def blocks(self) -> int:
        """Distinct block ids held anywhere."""
        return len(self._holders)

    def instances(self) -> set[str]:
        return set(self._by_instance)

    def is_foreign(self, instance: str) -> bool:
        return any(self._state(n).foreign for n in self.slots_of(instance))

    def _state(self, slot: int) -> _SlotState:
        state = self._slots[slot]
        assert state is not None
        return state

    # the holders dict

    def _add(self, slot: int, state: _SlotState, key: int) -> None:
        holders = self._holders
        v = holders.get(key)
        if v is None:
            holders[key] = self._ints[slot]
        elif v >= 0:
            if v == slot:
                return
            holders[key] = ~((1 << v) | (1 << slot))
        else:
            mask = ~v
            if mask >> slot & 1:
                return
            holders[key] = ~(mask | 1 << slot)
        state.held += 1
        state.log.append(key)

    def _remove(self, slot: int, state: _SlotState, key: int) -> None:
        holders = self._holders
        v = holders.get(key)
        if v is None:
            return
        if v >= 0:
            if v != slot:
                return
            del holders[key]
        else:
            mask = ~v
            if not mask >> slot & 1:
                return
            mask &= ~(1 << slot)
            holders[key] = self._ints[mask.bit_length() - 1] if mask & (mask - 1) == 0 else ~mask
        state.held -= 1
        if len(state.log) > 2 * state.held + 1024:
            self._compact(slot, state)

    def holds(self, slot: int, key: int) -> bool:
        v = self._holders.get(key)
        return v is not None and (v == slot if v >= 0 else bool(~v >> slot & 1))

    def _compact(self, slot: int, state: _SlotState) -> None:
        state.log = array("Q", dict.fromkeys(k for k in state.log if self.holds(slot, k)))

    # events

    def apply(self, slot: int, events: Sequence[KvEvent], hasher: BlockHasher | None = None) -> None:
        """One batch's events in order. With `hasher`, a chain's first block is checked against our
        own hash: a mismatch marks the slot foreign (its worker hashes with another seed) and clears it."""
        state = self._state(slot)
        for ev in events:
            try:
                self._apply_one(slot, state, ev, hasher)
            except (ArithmeticError, ValueError) as exc:  # a forged or broken event: skip it alone
                self.bad_events += 1
                log.debug("KV index: skipping an event of slot %d: %s", slot, exc)

    def _apply_one(self, slot: int, state: _SlotState, ev: KvEvent, hasher: BlockHasher | None) -> None:
        if isinstance(ev, KvStored):
            if ev.medium not in (None, "GPU") or state.foreign:
                return
            if ev.lora_name is not None:
                self._store_lora(slot, state, ev)
                return
            if hasher is not None and ev.parent_block_hash is None and ev.block_hashes:
                if (
                    ev.block_size == hasher.block_size
                    and hasher.chain(ev.token_ids[: ev.block_size]) != ev.block_hashes[:1]
                ):
                    self.clear(slot)
                    state.foreign = True
                    return
            for h in ev.block_hashes:
                self._add(slot, state, h)
        elif isinstance(ev, KvRemoved):
            if ev.medium not in (None, "GPU"):
                return
            for h in ev.block_hashes:
                key = state.lora.pop(h, None) if state.lora else None
                self._remove(slot, state, h if key is None else key)
        elif isinstance(ev, KvCleared):
            self.clear(slot)

    def _store_lora(self, slot: int, state: _SlotState, ev: KvStored) -> None:
        assert ev.lora_name is not None
        parent = None
        if ev.parent_block_hash is not None:
            parent = state.lora.get(ev.parent_block_hash)
            if parent is None:  # its parent is gone or was never seen: the chain cannot match
                return
        keys = lora_chain(ev.lora_name, ev.token_ids, ev.block_size, parent)
        for h, key in zip(ev.block_hashes, keys, strict=False):
            state.lora[h] = key
            self._add(slot, state, key)

    def clear(self, slot: int) -> None:
        state = self._state(slot)
        for key in dict.fromkeys(state.log):
            self._remove_quiet(slot, key)
        state.log = array("Q")
        state.held = 0
        state.lora = {}
        state.foreign = False

    def _remove_quiet(self, slot: int, key: int) -> None:
        v = self._holders.get(key)
        if v is None:
            return
        if v >= 0:
            if v == slot:
                del self._holders[key]
            return
        mask = ~v
        if mask >> slot & 1:
            mask &= ~(1 << slot)
            self._holders[key] = self._ints[mask.bit_length() - 1] if mask & (mask - 1) == 0 else ~mask

    def drop(self, instance: str) -> None:
        """The instance is gone: forget its blocks and give its slots back."""
        for n in self._by_instance.pop(instance, {}).values():
            self.clear(n)
            self._slots[n] = None
            self._free.append(n)

    # lookups

    def overlap(self, chain: Sequence[int]) -> dict[str, int]:
        """Per instance, how many leading blocks of `chain` it holds (instances holding none left
        out); an instance with several ranks counts its best rank."""
        per_slot: dict[int, int] = {}
        holders = self._holders
        live = 0
        for i, key in enumerate(chain):
            v = holders.get(key)
            mask = 0 if v is None else (1 << v if v >= 0 else ~v)
            if i == 0:
                live = mask
            else:
                dropped = live & ~mask
                for s in _bits(dropped):
                    per_slot[s] = i
                live &= mask
            if not live:
                break
        for s in _bits(live):
            per_slot[s] = len(chain)
        out: dict[str, int] = {}
        slots = self._slots
        for s, n in per_slot.items():
            inst = slots[s].key[0]  # type: ignore[union-attr]
            if n > out.get(inst, 0):
                out[inst] = n
        return out
