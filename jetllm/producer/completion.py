"""A finished request assembled from its frames, for producers that want the whole result."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec

from ..errors import RequestFailed
from ..schemas import (
    AcceptedFrame,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    Frame,
    GenerateRequest,
    TokensFrame,
    Usage,
)


class Completion(msgspec.Struct, kw_only=True):
    """A finished request, assembled from its frames."""

    request_id: str
    token_ids: list[int]
    text: str | None
    finish_reason: str
    stop_reason: str | int | None
    usage: Usage
    worker: str
    choices: list[Completion] = []
    """For n > 1: one entry per choice (index order); the top-level fields are choice 0's."""


async def assemble(req: GenerateRequest, frames: AsyncIterator[Frame], n: int) -> Completion:
    tokens: list[list[int]] = [[] for _ in range(n)]
    texts: list[list[str]] = [[] for _ in range(n)]
    any_text = False
    worker = ""
    started = time.monotonic()
    async for frame in frames:
        if isinstance(frame, TokensFrame):
            _check_index(req, frame.index, n)
            tokens[frame.index].extend(frame.token_ids)
            if frame.text is not None:
                any_text = True
                texts[frame.index].append(frame.text)
        elif isinstance(frame, AcceptedFrame):
            worker = frame.worker
        elif isinstance(frame, ErrorFrame):
            raise RequestFailed(frame.code, frame.message, field=frame.field)
        elif isinstance(frame, FinalFrame):
            if not frame.choices:
                raise RequestFailed(ErrorCode.INTERNAL, f"{req.request_id}: its final frame has no choices")
            for c in frame.choices:
                _check_index(req, c.index, n)
            choices = [
                Completion(
                    request_id=req.request_id,
                    token_ids=tokens[c.index],
                    text="".join(texts[c.index]) if any_text else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    usage=frame.usage,
                    worker=worker,
                )
                for c in sorted(frame.choices, key=lambda c: c.index)
            ]
            first = choices[0]
            return msgspec.structs.replace(first, choices=choices if n > 1 else [])
    elapsed = time.monotonic() - started
    raise RequestFailed(  # pragma: no cover - generate() always ends with final or error
        ErrorCode.INTERNAL, f"{req.request_id} ended after {elapsed:.1f}s without a final frame"
    )


def _check_index(req: GenerateRequest, index: int, n: int) -> None:
    """A frame comes from outside the producer: a choice it names must be one the request has."""
    if not 0 <= index < n:
        raise RequestFailed(
            ErrorCode.INTERNAL,
            f"{req.request_id}: a frame names choice {index}, but the request has {n} (0..{n - 1})",
        )
