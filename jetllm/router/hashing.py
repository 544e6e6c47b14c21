"""Prompt -> block chain: the ids the index is keyed by.

Base-model blocks are keyed by vLLM's own block hash, reproduced here (vLLM 0.32,
v1/core/kv_cache_utils.py): SHA-256 over the pickle of `(parent digest, block token tuple,
extra keys)`, the first block's parent being NONE_HASH = SHA-256 over the pickle of the seed.
With the default algorithm (sha256) the seed is the fixed "vllm-none-hash" unless the worker's
PYTHONHASHSEED sets another, so every worker computes the same ids and the events' hashes can be
compared across instances without translation (docs/decisions.md, "Router block keys").

LoRA blocks cannot be keyed that way: vLLM mixes the adapter's local path into their hash, and
each worker keeps its adapters in its own directory. The router chain-hashes their tokens itself,
from a root that names the adapter, so they never match base blocks or another adapter's.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Literal

MASK64 = (1 << 64) - 1
DEFAULT_SEED = "vllm-none-hash"
HashAlgo = Literal["sha256", "sha256_cbor"]


def _serialize(algo: HashAlgo, value: object) -> bytes:
    if algo == "sha256":
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    import cbor2  # noqa: PLC0415 - only for workers started with --prefix-caching-hash-algo sha256_cbor

    return cbor2.dumps(value, canonical=True)


class BlockHasher:
    """The block ids of a token sequence, as the workers' engines compute them."""

    def __init__(self, block_size: int, *, seed: str = DEFAULT_SEED, algo: HashAlgo = "sha256") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.algo: HashAlgo = algo
        self._none = hashlib.sha256(_serialize(algo, seed)).digest()

    def digest(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        """vLLM's full block hash (32 bytes): the parent of the next block."""
        return hashlib.sha256(_serialize(self.algo, (parent or self._none, tuple(tokens), None))).digest()

    def chain(self, tokens: Sequence[int], adapter: str | None = None) -> list[int]:
        """64-bit ids of the full blocks of `tokens`, first block first."""
        size = self.block_size
        full = len(tokens) // size
        if adapter is not None:
            return lora_chain(adapter, tokens, size)
        out = []
        parent: bytes | None = None
        for i in range(full):
            parent = self.digest(parent, tokens[i * size : (i + 1) * size])
            out.append(int.from_bytes(parent, "big") & MASK64)
        return out


def lora_root(adapter: str) -> int:
    return int.from_bytes(hashlib.blake2b(b"jetllm-lora\0" + adapter.encode(), digest_size=8).digest(), "big")


def lora_block(parent: int, tokens: Sequence[int]) -> int:
    """The router's own id of a LoRA block: a chain hash of the tokens after the parent's id."""
    h = hashlib.blake2b(parent.to_bytes(8, "big"), digest_size=8)
    h.update(b"".join((t & 0xFFFFFFFF).to_bytes(4, "little") for t in tokens))  # any int a job may hold
    return int.from_bytes(h.digest(), "big")


def lora_chain(adapter: str, tokens: Sequence[int], size: int, parent: int | None = None) -> list[int]:
    out = []
    key = lora_root(adapter) if parent is None else parent
    for i in range(len(tokens) // size):
        key = lora_block(key, tokens[i * size : (i + 1) * size])
        out.append(key)
    return out
