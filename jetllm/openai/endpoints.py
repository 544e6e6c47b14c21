"""The generation endpoints a batch line may name, and one body of them as its single job: the
gateway's translation, for a body that is answered whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from .bodies import ChatRequest, CompletionRequest
from .errors import invalid
from .translate import Job, Route, chat_job, completion_jobs, decode

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)

_ID_PREFIX = {CHAT: "chatcmpl", COMPLETIONS: "cmpl"}


def response_id(endpoint: str, key: str) -> str:
    """A response's id: its endpoint's prefix and the key its jobs are named from (a fresh one
    per gateway request, a line's request id in a batch)."""
    return f"{_ID_PREFIX[endpoint]}-{key}"


@dataclass
class Prepared:
    """A body translated: what it asked (for reading the result back) and its job."""

    endpoint: str
    body: ChatRequest | CompletionRequest
    job: Job


def prepare(endpoint: str, body: Any, request_id: str) -> Prepared:
    """`body` (decoded JSON) as the one job `request_id`; raises OpenAIError naming the parameter
    as the gateway would, plus what only a whole answer refuses (streaming, several prompts)."""
    if endpoint not in ENDPOINTS:
        raise invalid(f"url must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", "url")
    raw = msgspec.json.encode(body)
    if endpoint == CHAT:
        chat: ChatRequest = decode(raw, ChatRequest)
        _not_streamed(chat)
        return Prepared(endpoint, chat, chat_job(chat, Route(chat.model), request_id))
    completion: CompletionRequest = decode(raw, CompletionRequest)
    _not_streamed(completion)
    jobs = completion_jobs(completion, Route(completion.model), request_id)
    if len(jobs) != 1:
        raise invalid(
            f"prompt holds {len(jobs)} prompts; a batch line takes one: give each its own line", "prompt"
        )
    return Prepared(endpoint, completion, jobs[0])


def _not_streamed(body: ChatRequest | CompletionRequest) -> None:
    if body.stream:
        raise invalid("stream must be false: a batch line is answered by one whole response", "stream")
