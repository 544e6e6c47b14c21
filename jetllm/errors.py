"""Exceptions: one class per failure a caller would handle differently, each with one clear message."""

from __future__ import annotations

from .schemas import ErrorCode


class JetllmError(Exception):
    """The one base of jetllm's errors: each carries the ErrorCode the wire would show for it (a
    class's own, or `code` for one whose code depends on the case) and the field it is about."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, field: str | None = None, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        if code is not None:
            self.code = code


class ServerTooOld(JetllmError):
    """The NATS server predates 2.10 and would silently drop stream and consumer settings."""


class JetStreamUnavailable(JetllmError):
    """The NATS server answers, but JetStream is not enabled on it."""


class ReplicasUnavailable(JetllmError):
    """Streams were asked for more copies than the NATS servers can hold (replicas > 1 on a server
    that is not in a JetStream cluster)."""


class PayloadTooLarge(JetllmError):
    code = ErrorCode.PAYLOAD_TOO_LARGE


class WorkerSilent(JetllmError):
    code = ErrorCode.WORKER_SILENT


class AcceptTimeout(JetllmError):
    code = ErrorCode.TIMEOUT


class FrameGap(JetllmError):
    """Frames were lost between worker and producer (for example a slow consumer)."""


class RequestFailed(JetllmError):
    """The worker answered with an error frame."""

    def __init__(self, code: ErrorCode, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{code.value}: {message}", field=field, code=code)
        self.remote_message = message


class RequestRejected(JetllmError):
    """A job that cannot be served as it is; it goes to the dead-letter stream."""

    def __init__(self, code: ErrorCode, message: str, *, field: str | None = None) -> None:
        super().__init__(message, field=field, code=code)


class EngineDead(JetllmError):
    """The engine is gone; the worker hands its jobs back and exits."""


class EngineRequestError(JetllmError):
    """The engine failed one request and survived."""

    code = ErrorCode.ENGINE_ERROR


class NotPermitted(JetllmError):
    """The NATS server refused a publish or subscribe for this connection's identity; the message
    names the subject and the access roles that may (subjects/denials.py)."""

    def __init__(self, message: str, *, op: str, subject: str) -> None:
        super().__init__(message)
        self.op = op
        self.subject = subject


class InsecureConnection(JetllmError):
    """TLS was required or expected, and the connection would not have it."""


class ConnectRefused(JetllmError):
    """The server refused this connection's credentials or TLS settings: retrying cannot help."""


class NatsSettingsError(JetllmError):
    """Credentials or TLS settings that cannot be what was meant (the message names the variable)."""
