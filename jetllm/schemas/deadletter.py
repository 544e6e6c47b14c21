"""A job that could not be served, kept with the reason so an operator can inspect or replay it."""

from __future__ import annotations

from .common import ErrorCode, Report


class DeadLetter(Report):
    code: ErrorCode
    reason: str
    subject: str
    """The job subject it was published to, for replay."""
    deliveries: int
    worker: str
    failed_at: float
    """Unix time."""
    request_id: str | None = None
    headers: dict[str, str] = {}
    payload: bytes = b""
    """The job exactly as published; empty when it was too big to keep beside the reason (the reason says so)."""
