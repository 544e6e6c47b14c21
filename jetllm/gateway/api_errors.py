"""OpenAI's error shape for the files and batches endpoints: one JSON answer per failure, with
the status the SDK turns into its typed exceptions."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable

import nats.errors
import nats.js.errors
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ..batches.service import ApiError
from ..openai.errors import RETRY_AFTER_STATUSES, OpenAIError
from ..schemas import ErrorCode
from .capacity import unreachable
from .service import Gateway, GatewayConfig

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]

OUT_OF_REACH = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
)
"""NATS or JetStream out of reach for now (a stream leader moving too): a 503 to retry, not a 500."""


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    kind: str | None = None,
    retry_after: int | None = None,
) -> JSONResponse:
    """`retry_after`: sent as Retry-After on a 429 or 503, as every such answer of the gateway."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    headers = (
        {"Retry-After": str(retry_after)}
        if retry_after is not None and status in RETRY_AFTER_STATUSES
        else None
    )
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status, headers)


def _gateway(request: Request) -> Gateway | None:
    """The gateway serving `request`; None for an app that has only these routes (tests)."""
    return getattr(request.app.state, "gateway", None)


def _retry_after(request: Request) -> int:
    gw = _gateway(request)
    return gw.config.retry_after if gw is not None else GatewayConfig.retry_after


def answers_errors(handler: Handler) -> Handler:
    """ApiError as its status (429 and 503 with Retry-After); NATS out of reach as a 503 with
    Retry-After, as the generation endpoints answer it; a client that hangs up while sending its
    body as a 499, as they count it (nobody reads the answer); anything else as a 500 naming no
    internals, logged here."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ClientDisconnect:
            return error_response(
                499,
                "the client hung up while sending the body",
                code=ErrorCode.CANCELLED.value,
                kind="cancelled_error",
            )
        except ApiError as exc:
            return error_response(
                exc.status, exc.message, param=exc.param, kind=exc.kind, retry_after=_retry_after(request)
            )
        except OUT_OF_REACH as exc:
            log.warning("%s %s: NATS out of reach: %r", request.method, request.url.path, exc)
            return _openai_error(unreachable(exc, _retry_after(request)))
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(500, "internal error; see the gateway's log")

    return wrapped


def _openai_error(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), err.status, err.headers())


def counted(endpoint: str) -> Callable[[Handler], Handler]:
    """Count the handler's answers in the gateway's `jetllm_gateway_requests_total` under
    `endpoint`, as the generation endpoints' are (499: the client hung up)."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def wrapped(request: Request) -> Response:
            started = time.monotonic()
            response = await handler(request)
            gw = _gateway(request)
            if gw is not None:
                gw.metrics.answered(endpoint, response.status_code, time.monotonic() - started)
            return response

        return wrapped

    return decorate
