"""The engine's own prefix cache as sets of block ids, so a decode worker can tell how much of a
prompt its engine would not compute again (roles/decode/policy.py).

vLLM cannot be asked what it holds, but its KV-cache events say it, and the worker already reads
them for the relay (kvevents.py): following them costs the engine nothing. Only base-model blocks
on the engine's device count. An adapter's blocks hash the adapter in (a base prompt's ids never
match them), and blocks offloaded to another medium must be loaded back, so neither is the prefix
cache a local prefill would hit. Ids are all it keeps, per data-parallel rank, never more than the
engine has blocks: removals and clears take ids out, a relay resync replaces them with its view,
and past the limit the oldest go (a lost removal must not grow it for ever).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence

from ..router.hashing import DEFAULT_SEED, MASK64, BlockHasher
from ..schemas import KvEvent, KvRemoved, KvStored
from .engine import EngineFacts

log = logging.getLogger(__name__)

DEVICE_MEDIA = (None, "GPU")
"""Media of the engine's own cache: vLLM names its device blocks "GPU" whatever the device."""
HASH_ALGOS = ("sha256", "sha256_cbor")
"""vLLM's block hashes router/hashing.py reproduces (not the xxhash ones)."""
DEFAULT_LIMIT = 1 << 20


class CachedBlocks:
    def __init__(self, hasher: BlockHasher, limit: int = DEFAULT_LIMIT) -> None:
        self._hasher = hasher
        self._limit = max(1, limit)
        self._ranks: dict[int, dict[int, None]] = {}

    @classmethod
    def for_engine(cls, facts: EngineFacts) -> CachedBlocks | None:
        """None when the engine says nothing this could follow or match: no KV-cache events, or a
        block hash the worker cannot reproduce."""
        if not facts.kv_events or not facts.block_size:
            return None
        algo = facts.prefix_hash_algo
        if algo not in HASH_ALGOS:
            log.warning(
                "the engine's prefix-cache hash %s cannot be reproduced here, so the decode role "
                "does not see its prefix cache (--engine-arg prefix_caching_hash_algo=sha256 does)",
                algo,
            )
            return None
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)  # the engine reads the same variable
        hasher = BlockHasher(facts.block_size, seed=seed, algo=algo)  # type: ignore[arg-type]
        return cls(hasher, facts.num_kv_blocks or DEFAULT_LIMIT)

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._ranks.values())

    def apply(self, rank: int, events: Iterable[KvEvent]) -> None:
        """One batch of a rank's events, in engine order (a resync's snapshot starts with a clear,
        so it replaces what was there)."""
        ids = self._ranks.setdefault(rank, {})
        for ev in events:
            if isinstance(ev, KvStored):
                if ev.lora_name is not None or ev.medium not in DEVICE_MEDIA:
                    continue
                for h in ev.block_hashes:
                    ids.pop(h, None)  # stored again: the newest
                    ids[h] = None
                while len(ids) > self._limit:
                    del ids[next(iter(ids))]
            elif isinstance(ev, KvRemoved):
                if ev.medium in DEVICE_MEDIA:
                    for h in ev.block_hashes:
                        ids.pop(h, None)
            else:
                ids.clear()

    def cached_tokens(self, tokens: Sequence[int]) -> int:
        """Tokens of the prompt's leading full blocks that one rank holds (vLLM hits a prefix only
        up to the first block it misses, so hashing stops there)."""
        if not any(self._ranks.values()):
            return 0
        size = self._hasher.block_size
        ranks = [ids for ids in self._ranks.values() if ids]
        parent: bytes | None = None
        blocks = 0
        for i in range(len(tokens) // size):
            parent = self._hasher.digest(parent, tokens[i * size : (i + 1) * size])
            h = int.from_bytes(parent, "big") & MASK64
            ranks = [ids for ids in ranks if h in ids]
            if not ranks:
                break
            blocks += 1
        return blocks * size
