"""KV-cache events: which prefix-cache blocks an instance holds, as a replayable stream.

Published on `jetllm.<ns>.kv.<model>.<instance>` (stream JETLLM_<NS>_KV). `seq` counts an
instance's batches 1, 2, 3, ... with no gaps, across the restarts of an instance id, so a
consumer that sees a jump knows it missed batches and must resynchronise.

Applying the events in order to a set of block hashes per (instance, dp_rank) gives the blocks
the engine holds. Block hashes are the engine's own ids: opaque, only meaningful within one
instance (a router that compares instances hashes `token_ids` itself).
"""

from __future__ import annotations

from .common import Report, Tolerant


class KvStored(Tolerant, kw_only=True, tag_field="type", tag="stored"):
    """A chain of full blocks entered the prefix cache; block i holds
    `token_ids[i * block_size:(i + 1) * block_size]` and is the parent of block i + 1."""

    block_hashes: list[int]
    """The engine's ids of the blocks (unsigned 64-bit), parent first."""
    parent_block_hash: int | None = None
    """The block before the first one; None when the chain starts the sequence."""
    token_ids: list[int]
    """The tokens of all the blocks, block after block."""
    block_size: int
    """Tokens per block."""
    lora_name: str | None = None
    """The LoRA adapter the blocks were computed with (blocks of different adapters never match)."""
    medium: str | None = None
    """The cache tier as vLLM names it ("GPU" for the engine's own cache, on CPU hosts too)."""


class KvRemoved(Tolerant, kw_only=True, tag_field="type", tag="removed"):
    """Blocks were evicted from the prefix cache."""

    block_hashes: list[int]
    medium: str | None = None
    """The tier they left (see KvStored.medium)."""


class KvCleared(Tolerant, kw_only=True, tag_field="type", tag="cleared"):
    """Every block of this data-parallel rank is gone (prefix cache reset, or the start of a resync)."""


KvEvent = KvStored | KvRemoved | KvCleared


class KvResync(Tolerant, kw_only=True):
    """Marks the batches of a snapshot: each rank's first batch starts with a KvCleared, then
    stores the blocks the relay knows to be cached (parents before children)."""

    reason: str
    """Why: "start" (worker started), "requested" (kv-resync verb), "engine-gap" (the relay lost
    engine batches it could not replay), "backlog" (NATS was unreachable longer than the relay buffers)."""
    part: int
    """1, 2, ... over the snapshot's batches (all ranks)."""
    parts: int
    """The snapshot is whole once part == parts has been applied."""
    blocks: int = 0
    """Blocks in the whole snapshot, all ranks together."""


class KvEventBatch(Report, kw_only=True):
    """Events of one engine step (or one part of a snapshot), in the order they happened."""

    instance: str
    """The worker instance whose engine holds the blocks."""
    model: str
    """The served model name (jobs use it); LoRA blocks name their adapter in `lora_name`."""
    dp_rank: int = 0
    """The engine's data-parallel rank: each rank has its own cache and its own block set."""
    seq: int
    """1, 2, 3, ... per instance; a jump means batches were lost (expired from the stream)."""
    engine_seq: int | None = None
    """vLLM's own batch number on this rank (None in snapshots): for diagnosis only."""
    engine_ts: float = 0.0
    """When the engine produced the events (Unix seconds)."""
    events: list[KvEvent]
    """Apply in order; a KvCleared empties this rank's set before the events after it."""
    resync: KvResync | None = None
    """Set on every batch of a snapshot."""
