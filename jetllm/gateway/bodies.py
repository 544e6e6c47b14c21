"""Request bodies read with a limit: refused while they arrive, with or without a content-length."""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.types import Message


def limited(request: Request, limit: int, too_large: Callable[[str], Exception]) -> Request:
    """`request`, whose body raises `too_large(<size as text>)` once it passes `limit` bytes: at once
    for a content-length over it, else when the byte past it arrives (nothing more is read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    received = 0

    async def counted() -> Message:
        nonlocal received
        message = await request.receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise too_large(f"more than {limit}")
        return message

    return Request(request.scope, counted)
