"""Control traffic: cancellation and instance status (request/reply, core NATS)."""

from __future__ import annotations

import msgspec

from .common import Message


class CancelRequest(Message):
    """Published to `jetllm.<ns>.cancel.<request>`; every worker listens, the one running it aborts."""

    request_id: str
    reason: str | None = None


class StatusRequest(Message):
    pass


class WorkerStatus(Message):
    instance: str
    role: str
    model: str
    state: str
    """starting | serving | draining | stopped | engine_dead"""
    slots: int
    in_flight: int
    request_ids: list[str] = []
    engine_unfinished: int = 0
    """Requests the engine itself still holds (vLLM's own count)."""
    started_at: float = 0.0
    version: str = ""
    host: str = ""
    pid: int = 0
    extra: dict[str, str] = msgspec.field(default_factory=dict)
