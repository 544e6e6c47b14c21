"""Reply frames, streamed on the job's reply subject; `kind` tells them apart.

`seq` counts the frames that carry content (accepted, tokens, final, error) from 1 with no
gaps; a heartbeat repeats the last seq sent so that a producer notices a lost frame even
while the request is quiet.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from .common import SCHEMA_VERSION, ErrorCode

FinishReason = Literal["stop", "length", "cancelled", "error", "repetition"]


class _Frame(msgspec.Struct, kw_only=True, tag_field="kind", forbid_unknown_fields=True):
    v: int = SCHEMA_VERSION
    seq: int


class AcceptedFrame(_Frame, tag="accepted"):
    request_id: str
    worker: str
    """Instance id of the worker that runs the job."""
    model: str
    attempt: int = 1
    """JetStream delivery count of the job."""


class TokensFrame(_Frame, tag="tokens"):
    token_ids: list[int]
    index: int = 0
    """Choice index, for n > 1."""
    text: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None


class HeartbeatFrame(_Frame, tag="heartbeat"):
    pass


class Usage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""


class Choice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    index: int
    finish_reason: FinishReason
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the choice; None for EOS or length."""
    completion_tokens: int


class FinalFrame(_Frame, tag="final"):
    request_id: str
    choices: list[Choice]
    usage: Usage


class ErrorFrame(_Frame, tag="error"):
    request_id: str | None
    code: ErrorCode
    message: str
    field: str | None = None
    """The offending field, as a path such as `$.stop.max_tokens`, when there is one."""
    retryable: bool = False


Frame = AcceptedFrame | TokensFrame | HeartbeatFrame | FinalFrame | ErrorFrame
