"""Errors as OpenAI's server shows them: one JSON shape, the right status, and one table from
jetllm's ErrorCode values to statuses, for the gateway's answers and a batch's error lines alike."""

from __future__ import annotations

from typing import Any

from ..errors import JetllmError
from ..schemas import ErrorCode

STATUS: dict[ErrorCode, int] = {
    ErrorCode.MALFORMED: 400,
    ErrorCode.UNSUPPORTED_VERSION: 400,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.ADAPTER_INVALID: 400,
    ErrorCode.LORA_DISABLED: 400,
    ErrorCode.ADAPTER_NOT_ALLOWED: 403,
    ErrorCode.MODEL_NOT_SERVED: 404,
    ErrorCode.UNKNOWN_ADAPTER: 404,
    ErrorCode.ADAPTER_NOT_FOUND: 404,
    ErrorCode.CONFLICT: 409,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.CANCELLED: 499,
    ErrorCode.ENGINE_ERROR: 500,
    ErrorCode.INTERNAL: 500,
    ErrorCode.MIGRATION_BUDGET_EXHAUSTED: 503,
    ErrorCode.NOT_MIGRATABLE: 503,
    ErrorCode.DELIVERIES_EXHAUSTED: 503,
    ErrorCode.ADAPTER_NOT_LOADED: 503,
    ErrorCode.NO_ADAPTER_SLOT: 503,
    ErrorCode.KV_TRANSFER_FAILED: 503,
    ErrorCode.WORKER_SILENT: 503,
    ErrorCode.TIMEOUT: 503,
    ErrorCode.EXPIRED: 504,
}
"""HTTP status of each ErrorCode; a code missing here (a newer worker's) is a 500."""

RETRY_AFTER_STATUSES = frozenset({429, 503})

_TYPES = {
    400: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled_error",
}


class OpenAIError(Exception):
    """A request answered with an error (by the gateway, or in a batch's error file); `code` is an
    ErrorCode value or one of the gateway's own (`model_not_found`, `no_capacity`, `queue_full`,
    `request_too_large`)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is not None and self.status in RETRY_AFTER_STATUSES:
            return {"Retry-After": str(self.retry_after)}
        return {}


def invalid(message: str, param: str | None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=ErrorCode.INVALID_REQUEST.value)


def from_code(
    code: ErrorCode, message: str, *, param: str | None = None, retry_after: int = 1
) -> OpenAIError:
    status = STATUS.get(code, 500)
    return OpenAIError(
        status,
        message,
        param=param,
        code=code.value,
        retry_after=retry_after if status in RETRY_AFTER_STATUSES else None,
    )


def from_exception(exc: JetllmError, *, param: str | None = None, retry_after: int = 1) -> OpenAIError:
    """A producer-side failure (publish refused, no worker took the job in time, ...)."""
    return from_code(exc.code, exc.message, param=param, retry_after=retry_after)


def too_large(message: str) -> OpenAIError:
    return OpenAIError(413, message, code="request_too_large")
