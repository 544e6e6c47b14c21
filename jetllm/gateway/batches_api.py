"""`/v1/batches`: create, retrieve, list (paged), cancel; state in NATS, run by batch runners."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..batches.service import ApiError, BatchService, TooLarge, batch_object
from .api_errors import answers_errors, counted
from .bodies import limited

MAX_BODY_BYTES = 1 << 20
"""Largest JSON body of a batches request: a create names a file and takes small metadata, so a
body past this is refused while it arrives, never read whole."""


_LIMIT = re.compile(r"[0-9]{1,3}")
"""ASCII digits only: str.isdigit also takes superscripts and other scripts' digits, which int()
then refuses."""


async def _body(request: Request) -> bytes:
    def too_large(size: str) -> TooLarge:
        return TooLarge(
            f"the request body is {size} bytes; at most {MAX_BODY_BYTES} are accepted here (the lines "
            "of a batch go in an uploaded file: POST /v1/files)"
        )

    return await limited(request, MAX_BODY_BYTES, too_large).body()


async def _json(request: Request) -> dict:
    try:
        body = json.loads(await _body(request) or b"null")
    except ValueError as exc:
        raise ApiError(f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def routes(service: Callable[[], BatchService]) -> list[Route]:
    @counted("batches")
    @answers_errors
    async def create(request: Request) -> Response:
        body = await _json(request)
        for name in ("input_file_id", "endpoint"):
            if not isinstance(body.get(name), str):
                raise ApiError(f"{name} is required (a string)", param=name)
        state = await service().create(
            body["input_file_id"],
            body["endpoint"],
            body.get("completion_window", "24h"),
            body.get("metadata"),
        )
        return JSONResponse(batch_object(state))

    @answers_errors
    async def retrieve(request: Request) -> Response:
        return JSONResponse(batch_object(await service().get(request.path_params["batch_id"])))

    @answers_errors
    async def list_batches(request: Request) -> Response:
        limit_text = request.query_params.get("limit", "20")
        if not _LIMIT.fullmatch(limit_text) or not 1 <= int(limit_text) <= 100:
            raise ApiError("limit must be an integer from 1 to 100", param="limit")
        states, more = await service().list(request.query_params.get("after"), int(limit_text))
        data = [batch_object(s) for s in states]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "has_more": more,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
            }
        )

    @answers_errors
    async def cancel(request: Request) -> Response:
        return JSONResponse(batch_object(await service().cancel(request.path_params["batch_id"])))

    return [
        Route("/v1/batches", create, methods=["POST"]),
        Route("/v1/batches", list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", retrieve, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", cancel, methods=["POST"]),
    ]
