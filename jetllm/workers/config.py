"""A worker's settings, as the CLI (or a test) gives them."""

from __future__ import annotations

import msgspec

from ..subjects.setup import QueuePolicy
from .lora.manager import LoraSettings


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
