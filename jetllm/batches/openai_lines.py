"""One OpenAI request body as a generate job, and a finished job as OpenAI's response body.

A minimal translation for batch lines (messages or prompt, max_tokens, temperature, top_p, seed,
stop, n=1). The gateway's translation of /v1/chat/completions and /v1/completions is meant to
become the single home of this; until then both exist.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..schemas import (
    ChatMessage,
    ChatPrompt,
    ErrorCode,
    GenerateRequest,
    Prompt,
    Result,
    SamplingOptions,
    TextPrompt,
    TokensPrompt,
)
from ..subjects.codec import field_path

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)

_IGNORED = frozenset({"user", "stream_options", "store", "metadata"})
"""Fields OpenAI accepts that change nothing about the output here."""
_KNOWN = frozenset(
    {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p"}
    | {"seed", "stop", "n", "stream", "ignore_eos", "min_tokens"}
)
"""OpenAI's fields above, and two of vLLM's extras (for fixed-length benchmark lines)."""


class BadBody(ValueError):
    """A request body this translation cannot run; `param` names the field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise BadBody(f"{where}[{i}] must be a text part ({{'type': 'text', 'text': ...}})", where)
            parts.append(part["text"])
        return "".join(parts)
    raise BadBody(f"{where} must be a string or a list of text parts", where)


def _prompt(body: dict[str, Any], url: str) -> Prompt:
    if url == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadBody("body.messages must be a non-empty list of messages", "body.messages")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadBody(f"body.messages[{i}] needs a role", f"body.messages[{i}].role")
            out.append(
                ChatMessage(
                    role=m["role"], content=_text_content(m.get("content"), f"body.messages[{i}].content")
                )
            )
        return ChatPrompt(out)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return TextPrompt(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return TokensPrompt(list(prompt))
    raise BadBody("body.prompt must be one non-empty string or one list of token ids", "body.prompt")


def to_request(body: Any, url: str, request_id: str) -> GenerateRequest:
    """The detached generate job of one batch line; raises BadBody naming the field."""
    if url not in ENDPOINTS:
        raise BadBody(f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}", "url")
    if not isinstance(body, dict):
        raise BadBody("body must be a JSON object", "body")
    for key in body:
        if key not in _KNOWN and key not in _IGNORED:
            raise BadBody(f"body.{key} is not supported in batch lines", f"body.{key}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadBody("body.model is required (the served model name)", "body.model")
    if body.get("n", 1) != 1:
        raise BadBody("body.n must be 1 in batch lines", "body.n")
    if body.get("stream"):
        raise BadBody("body.stream must be false in batch lines", "body.stream")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    raw = {
        "request_id": request_id,
        "model": model,
        "prompt": msgspec.to_builtins(_prompt(body, url)),
        "sampling": msgspec.to_builtins(
            SamplingOptions(
                temperature=body.get("temperature"), top_p=body.get("top_p"), seed=body.get("seed")
            )
        ),
        "stop": {
            "max_tokens": max_tokens,
            "stop": stops or [],
            "ignore_eos": body.get("ignore_eos", False),
            "min_tokens": body.get("min_tokens", 0),
        },
    }
    try:  # constraints of Annotated types are checked on conversion, with the path of the field
        return msgspec.convert(raw, GenerateRequest)
    except msgspec.ValidationError as exc:
        path = field_path(str(exc)) or ""
        param = "body." + _OPENAI_NAMES.get(path, path.removeprefix("$.").split(".")[-1])
        raise BadBody(f"{param}: {exc}", param) from None


_OPENAI_NAMES = {
    "$.stop.max_tokens": "max_tokens",
    "$.stop.stop": "stop",
    "$.stop.ignore_eos": "ignore_eos",
    "$.stop.min_tokens": "min_tokens",
    "$.sampling.temperature": "temperature",
    "$.sampling.top_p": "top_p",
    "$.sampling.seed": "seed",
    "$.model": "model",
}


_STATUS = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.MALFORMED: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.MODEL_NOT_SERVED: 404,
    ErrorCode.UNKNOWN_ADAPTER: 404,
    ErrorCode.CANCELLED: 499,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
}


def status_code(code: ErrorCode) -> int:
    """The HTTP status an OpenAI server would have answered a request that ended with `code`."""
    return _STATUS.get(code, 500)


def error_body(
    code: str, message: str, param: str | None = None, kind: str = "invalid_request_error"
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def response_body(url: str, result: Result, model: str, created: int) -> tuple[int, dict]:
    """(status_code, body) of a finished job, in the shape the endpoint answers."""
    if result.final is None:
        err = result.error
        code = err.code if err is not None else ErrorCode.INTERNAL
        message = err.message if err is not None else "the request ended without an output"
        status = status_code(code)
        kind = "invalid_request_error" if status < 500 else "server_error"
        param = err.field if err is not None else None
        return status, error_body(str(code), message, param, kind)
    final = result.final
    texts = result.text or [""] * len(final.choices)
    usage = {
        "prompt_tokens": final.usage.prompt_tokens,
        "completion_tokens": final.usage.completion_tokens,
        "total_tokens": final.usage.prompt_tokens + final.usage.completion_tokens,
    }
    choices: list[dict[str, Any]] = []
    for choice in final.choices:
        finish = "length" if choice.finish_reason == "length" else "stop"
        text = texts[choice.index] if choice.index < len(texts) else ""
        if url == CHAT:
            reply = {"role": "assistant", "content": text}
            choices.append(
                {"index": choice.index, "message": reply, "logprobs": None, "finish_reason": finish}
            )
        else:
            choices.append({"index": choice.index, "text": text, "logprobs": None, "finish_reason": finish})
    return 200, {
        "id": ("chatcmpl-" if url == CHAT else "cmpl-") + final.request_id,
        "object": "chat.completion" if url == CHAT else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }
