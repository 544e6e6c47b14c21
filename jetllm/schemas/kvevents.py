"""KV-cache events: which prefix-cache blocks an instance holds, as a replayable stream.

Published on `jetllm.<ns>.kv.<model>.<instance>` (stream JETLLM_<NS>_KV). `seq` counts an
instance's batches 1, 2, 3, ... with no gaps, across the restarts of an instance id, so a
consumer that sees a jump knows it missed batches and must resynchronise.

Applying the events in order to a set of block hashes per (instance, dp_rank) gives the blocks
the engine holds. Block hashes are the engine's own ids: opaque, only meaningful within one
instance (a router that compares instances hashes `token_ids` itself).
"""

from __future__ import annotations

import msgspec

from .common import Message


class KvStored(msgspec.Struct, kw_only=True, tag_field="type", tag="stored", forbid_unknown_fields=True):
    """A chain of full blocks entered the prefix cache; block i holds
    `token_ids[i * block_size:(i + 1) * block_size]` and is the parent of block i + 1."""

    block_hashes: list[int]
    parent_block_hash: int | None = None
    """The block before the first one; None when the chain starts the sequence."""
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    """The LoRA adapter the blocks were computed with (blocks of different adapters never match)."""
    medium: str | None = None
    """The cache tier as vLLM names it ("GPU" for the engine's own cache, on CPU hosts too)."""


class KvRemoved(msgspec.Struct, kw_only=True, tag_field="type", tag="removed", forbid_unknown_fields=True):
    """Blocks were evicted from the prefix cache."""

    block_hashes: list[int]
    medium: str | None = None


class KvCleared(msgspec.Struct, kw_only=True, tag_field="type", tag="cleared", forbid_unknown_fields=True):
    """Every block of this data-parallel rank is gone (prefix cache reset, or the start of a resync)."""


KvEvent = KvStored | KvRemoved | KvCleared


class KvResync(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Marks the batches of a snapshot: part 1 of each rank starts with a KvCleared, the parts
    after it store the blocks the relay knows to be cached; the snapshot is whole at part == parts."""

    reason: str
    """Why: "start" (worker started), "requested" (kv-resync verb), "engine-gap" (the relay lost
    engine batches it could not replay), "backlog" (NATS was unreachable longer than the relay buffers)."""
    part: int
    parts: int
    blocks: int = 0
    """Blocks in the whole snapshot, all ranks together."""


class KvEventBatch(Message, kw_only=True):
    """Events of one engine step (or one part of a snapshot), in the order they happened."""

    instance: str
    model: str
    dp_rank: int = 0
    seq: int
    """1, 2, 3, ... per instance; a jump means batches were lost (expired from the stream)."""
    engine_seq: int | None = None
    """vLLM's own batch number on this rank (None in snapshots): for diagnosis only."""
    engine_ts: float = 0.0
    """When the engine produced the events (Unix seconds)."""
    events: list[KvEvent]
    resync: KvResync | None = None
    """Set on every batch of a snapshot."""
