"""A worker's settings, as the CLI (or a test) gives them."""

from __future__ import annotations

import msgspec

from ..subjects.policy import QueuePolicy
from .lora.manager import LoraSettings


class DisaggSettings(msgspec.Struct, kw_only=True, frozen=True):
    """Prefill/decode disaggregation: when a decode worker hands a prompt to a prefill worker, and
    how long it waits for the blocks. The defaults are argued in docs/operations.md."""

    block_dir: str | None = None
    """The private directory the engine's KV connector exchanges block files in (set by the CLI)."""
    threshold: int = 256
    """Prompts shorter than this (in tokens) are prefilled by the decode worker itself."""
    cached_fraction: float = 0.5
    """A prompt whose cached share in the decode engine's prefix cache reaches this is prefilled
    there (0: never for that reason); seen through the KV-cache events the worker relays."""
    max_prefill_queue: int = 16
    """Prefill jobs waiting for a prefill worker beyond which a decode worker prefills itself."""
    prefill_timeout: float = 30.0
    """Seconds a decode worker waits for a prefill worker's answer before prefilling itself."""
    transfer_timeout: float = 30.0
    """Seconds a decode worker gives the blocks to arrive once they are announced."""
    stored: bool = False
    """Whether a decode worker asks for its blocks through the block stream (`PrefillRequest.
    stored`), which it can read back what it missed from, or straight to it (the default)."""
    kv_ttl: float = 120.0
    """Seconds the block store keeps blocks nobody removed (a decode worker died, say)."""
    connector: str = "jetllm"
    """The engine's KV connector (`--kv-connector`): jetllm's moves blocks through NATS; with
    one of vLLM's own, the connectors move them and the handoff messages only say so."""
    kv_store_bytes: int = 256 << 20
    """Bytes the block store holds at once; beyond it new blocks are refused (decode prefills).
    The server reserves them from its max_memory_store (1 GB in jetllm's embedded config)."""


class WorkerConfig(msgspec.Struct, kw_only=True):
    namespace: str = "default"
    role: str = "generate"
    """What the worker does with the jobs it pulls: a name in `roles.ROLES`."""
    slots: int = 0
    """Jobs this worker runs at once; it never holds more un-acked jobs than this.
    0: the engine's batch limit (max_num_seqs)."""
    heartbeat_interval: float = 0.5
    """A quiet request gets a heartbeat frame this often."""
    checkpoint_interval: float = 0.5
    """Seconds between request-log checkpoints of a request's token frames; 0: every frame."""
    detached_checkpoint_interval: float = 5.0
    """The same for a detached job (no reply subject): its newest tokens were seen by nobody."""
    max_migrations: int = 3
    """Default migration budget of a request: how often workers may die under it."""
    grace_period: float = 30.0
    """On SIGTERM, how long running requests may take to finish before they are handed back."""
    health_interval: float = 5.0
    health_timeout: float = 10.0
    pull_expires: float = 3.0
    registry_interval: float = 2.0
    """Seconds between registry heartbeats; a dead worker's record stops counting after 3 of them."""
    metrics_port: int | None = None
    """Prometheus endpoint port; 0 picks a free one (written to the registry), None: no endpoint."""
    instance: str | None = None
    max_embeds_bytes: int | None = None
    """Largest embeddings prompt accepted; None: a full context of float32 rows (capped at 1 GiB)."""
    policy: QueuePolicy = msgspec.field(default_factory=QueuePolicy)
    lora: LoraSettings = msgspec.field(default_factory=LoraSettings)
    disagg: DisaggSettings = msgspec.field(default_factory=DisaggSettings)
