"""How a namespace's job queues deliver and keep: the settings a side brings to the streams it
creates or joins (setup.py applies them)."""

from __future__ import annotations

from typing import Any

import msgspec


class QueuePolicy(msgspec.Struct, kw_only=True, frozen=True):
    """Delivery settings of the job queues; the defaults are argued in docs/operations.md.

    The stream settings (`max_age` and below) are None unless a side chooses them: None leaves an
    existing stream's setting as it is and gives a new stream the default (`DEFAULTS`)."""

    ack_wait: float = 10.0
    """Seconds before an un-acked job is redelivered; workers heartbeat every ack_wait/3."""
    max_deliver: int = 10
    """Deliveries of one job before JetStream gives up on it (then it is dead-lettered). A backstop:
    workers enforce each request's migration budget first, and planned hand-backs are free."""
    max_ack_pending: int = 10_000
    """Jobs in flight across all workers of one consumer; keep above the role's total slots."""
    replicas: int | None = None
    """Copies of each stream and bucket (3 on a JetStream cluster); None: existing ones keep theirs,
    new ones get the jobs stream's (see the module docstring)."""
    memory: bool = False
    """Streams a side creates are kept in memory (an existing stream keeps its storage)."""
    max_age: float | None = None
    """A job nobody serves within this time is dropped by the server (default 24 h)."""
    duplicate_window: float | None = None
    """Seconds within which a re-published request id is dropped as a duplicate (default 600)."""
    dlq_max_age: float | None = None
    """How long dead letters are kept (default 14 days)."""
    results_max_age: float | None = None
    """How long a finished request's result stays readable: batch resume, late producers
    (default 24 h)."""
    kv_events_max_age: float | None = None
    """How long KV-cache events stay replayable (default 1 h). A router needs history only to
    bridge its own restart; anything older is covered by asking the instances for a resync
    (docs/fleet.md)."""
    kv_events_max_msgs_per_subject: int | None = None
    """Batches kept per instance (default 100,000): about half an hour of a busy GPU engine (~50
    batches/s), so an unread stream stays bounded even within max_age."""

    def setting(self, name: str) -> Any:
        """A stream setting: as chosen, or its default."""
        value = getattr(self, name)
        return DEFAULTS[name] if value is None else value


DEFAULTS: dict[str, float] = {
    "max_age": 24 * 3600.0,
    "duplicate_window": 600.0,
    "dlq_max_age": 14 * 24 * 3600.0,
    "results_max_age": 24 * 3600.0,
    "kv_events_max_age": 3600.0,
    "kv_events_max_msgs_per_subject": 100_000,
}
"""What a new stream gets for a setting no side chose."""
