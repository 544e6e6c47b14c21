"""The line formats of `jetllm batch`: one request per input line, one result per output line."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from .common import ErrorCode, Strict, Tolerant
from .frames import Usage
from .generate import ChatMessage, OutputOptions, SamplingOptions, StopConditions, StructuredOutput


class BatchLine(Strict, kw_only=True, omit_defaults=True):
    """Exactly one of `prompt`, `messages`, `token_ids`; the rest is optional."""

    id: str | None = None
    """Your own id for the line, copied to its result."""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    model: str | None = None
    """Default: the model given on the command line."""
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    sampling: SamplingOptions | None = None
    stop: StopConditions | None = None
    output: OutputOptions | None = None
    structured: StructuredOutput | None = None
    """Default: the constraint given on the command line, if any."""


class BatchError(Tolerant, kw_only=True):
    code: ErrorCode
    message: str
    field: str | None = None


class BatchResult(Tolerant, kw_only=True):
    line: int
    """1-based line number in the input file."""
    id: str | None
    request_id: str
    text: str | None = None
    token_ids: list[int] = []
    finish_reason: str | None = None
    usage: Usage | None = None
    error: BatchError | None = None
