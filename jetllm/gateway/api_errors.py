"""OpenAI's error shape for the files and batches endpoints: one JSON answer per failure, with
the status the SDK turns into its typed exceptions."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..batches.service import ApiError

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None, kind: str | None = None
) -> JSONResponse:
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def answers_errors(handler: Handler) -> Handler:
    """ApiError as its status; anything else as a 500 naming no internals, logged here."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc.status, exc.message, param=exc.param, kind=exc.kind)
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(500, "internal error; see the gateway's log")

    return wrapped
