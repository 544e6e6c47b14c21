"""Control traffic: cancellation and instance status (request/reply, core NATS)."""

from __future__ import annotations

import msgspec

from .common import Command, Report


class CancelRequest(Command):
    """Published to `jetllm.<ns>.cancel.<request>`; every worker listens, the one running it aborts."""

    request_id: str
    reason: str | None = None
    below_attempt: int | None = None
    """Stop only attempts older than this one (a newer attempt took the job over); None: all."""


class StatusRequest(Command):
    """Sent to `jetllm.<ns>.ctl.status` (every worker answers) or to one instance's status subject."""


class WorkerStatus(Report):
    """A worker's answer to a StatusRequest."""

    instance: str
    role: str
    model: str
    state: str
    """starting | serving | sleeping | draining | stopped | engine_dead (the worker's state machine,
    workers/state.py; the registry shows the last three as draining)"""
    slots: int
    in_flight: int
    """Jobs it holds (pulled and not yet settled)."""
    request_ids: list[str] = []
    engine_unfinished: int = 0
    """Requests the engine itself still holds (vLLM's own count)."""
    started_at: float = 0.0
    version: str = ""
    host: str = ""
    pid: int = 0
    extra: dict[str, str] = msgspec.field(default_factory=dict)
    """Engine facts and counters (jobs pulled, acked, handed back, dead-lettered, cancelled)."""
