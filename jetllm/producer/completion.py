"""A finished request assembled from its frames, for producers that want the whole result."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import msgspec

from ..errors import RequestFailed
from ..schemas import (
    AcceptedFrame,
    Choice,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    Frame,
    GenerateRequest,
    Result,
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
            check_choices(req, frame, n)
            tokens[frame.index].extend(frame.token_ids)
            if frame.text is not None:
                any_text = True
                texts[frame.index].append(frame.text)
        elif isinstance(frame, AcceptedFrame):
            worker = frame.worker
        elif isinstance(frame, ErrorFrame):
            raise RequestFailed(frame.code, frame.message, field=frame.field)
        elif isinstance(frame, FinalFrame):
            check_choices(req, frame, n)
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


def check_choices(req: GenerateRequest, frame: TokensFrame | FinalFrame, n: int | None = None) -> None:
    """Frames come from outside whoever reads them (anyone may publish to a request's inbox): a
    choice a token frame names must be one the request has (`n`, else `req.sampling.n`), and its
    final frame must name each of them exactly once. Else RequestFailed(internal) naming the
    choice, never an IndexError, nor a choice left out, filled twice, or another prompt's filled.
    The one check of producers (`assemble`) and the gateway alike."""
    n = req.sampling.n if n is None else n
    if isinstance(frame, TokensFrame):
        _check_index(req.request_id, frame.index, n)
    else:
        _check_final(req.request_id, frame.choices, n)


def check_result(request_id: str, result: Result, n: int | None = None) -> None:
    """A Result stored in the request log comes from outside too (anyone who may publish to the
    log): it must end the request (a final or an error frame), hold one entry per choice in each
    of its per-choice lists (`token_ids`; `text` and `logprobs` when there), no more choices than
    the request has (`n`; None: a reader without the request goes by its `token_ids`), and a final
    frame must name each of its choices once. Else RequestFailed(internal) saying what is wrong."""
    if result.final is None and result.error is None:
        raise _malformed(request_id, "its stored result has neither a final nor an error frame")
    choices = len(result.token_ids)
    if n is not None and (choices > n or (result.final is not None and choices != n)):
        raise _malformed(
            request_id, f"its stored result holds the output of {choices} choices; the request has {n}"
        )
    for name, per_choice in (("text", result.text), ("logprobs", result.logprobs)):
        if per_choice is not None and len(per_choice) != choices:
            raise _malformed(
                request_id,
                f"its stored result has {len(per_choice)} entries of {name} for {choices} choices",
            )
    if result.final is not None:
        if choices == 0:
            raise _malformed(request_id, "its stored result has a final frame but the output of no choice")
        _check_final(request_id, result.final.choices, choices, "its stored result")


def _check_final(request_id: str, choices: Sequence[Choice], n: int, whose: str = "the request") -> None:
    """A final frame names each of the `n` choices (0..n-1) exactly once."""
    for c in choices:
        _check_index(request_id, c.index, n, whose)
    named = Counter(c.index for c in choices)
    missing = [i for i in range(n) if i not in named]
    if missing:
        lacks = ", ".join(map(str, missing))
        raise _malformed(request_id, f"its final frame lacks choice {lacks}; {whose} has {n} (0..{n - 1})")
    twice = [i for i, times in sorted(named.items()) if times > 1]
    if twice:
        raise _malformed(
            request_id, f"its final frame names choice {', '.join(map(str, twice))} more than once"
        )


def _check_index(request_id: str, index: int, n: int, whose: str = "the request") -> None:
    """A choice a frame names must be one the request has."""
    if not 0 <= index < n:
        raise _malformed(request_id, f"a frame names choice {index}, but {whose} has {n} (0..{n - 1})")


def _malformed(request_id: str, message: str) -> RequestFailed:
    return RequestFailed(ErrorCode.INTERNAL, f"{request_id}: {message}")
