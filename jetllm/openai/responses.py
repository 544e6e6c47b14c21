"""jetllm's reply frames as whole OpenAI responses (streams.py makes the stream chunks).

Log-probabilities name tokens as `token_id:<id>` (the form of vLLM's `return_tokens_as_token_ids`):
neither the gateway nor a batch runner has a tokenizer, and the worker sends ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..schemas import FinalFrame, TokensFrame, Usage
from . import tools

_FINISH = {"stop": "stop", "length": "length"}


def finish_reason(reason: str) -> str:
    return _FINISH.get(reason, reason)


def tool_finish(mode: str, reason: str) -> str:
    """A choice's finish reason once its tool calls were read: "tool_calls" where the model chose
    to call ("auto", "required") and stopped by itself; a named function was not the model's
    choice, and a cut-off ("length") stays visible either way."""
    if mode in ("auto", "required") and reason == "stop":
        return "tool_calls"
    return reason


def token_name(token: int) -> str:
    return f"token_id:{token}"


def usage(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def add_usage(a: Usage | None, b: Usage) -> Usage:
    if a is None:
        return b
    return Usage(
        prompt_tokens=a.prompt_tokens + b.prompt_tokens,
        completion_tokens=a.completion_tokens + b.completion_tokens,
        cached_tokens=a.cached_tokens + b.cached_tokens,
    )


def chat_logprobs(frame: TokensFrame) -> list[dict[str, Any]]:
    if frame.logprobs is None:
        return []
    out = []
    for k, (tok, lp) in enumerate(zip(frame.token_ids, frame.logprobs, strict=False)):
        top = frame.top_logprobs[k] if frame.top_logprobs and k < len(frame.top_logprobs) else {}
        out.append(
            {
                "token": token_name(tok),
                "logprob": lp,
                "bytes": None,
                "top_logprobs": [
                    {"token": token_name(t), "logprob": v, "bytes": None} for t, v in top.items()
                ],
            }
        )
    return out


@dataclass
class CompletionLogprobs:
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, frame: TokensFrame, offset: int) -> None:
        """`offset`: where the frame's text starts; each of its tokens is given that offset (the
        gateway cannot split a frame's text between its tokens)."""
        if frame.logprobs is None:
            return
        for k, (tok, lp) in enumerate(zip(frame.token_ids, frame.logprobs, strict=False)):
            top = frame.top_logprobs[k] if frame.top_logprobs and k < len(frame.top_logprobs) else {}
            self.tokens.append(token_name(tok))
            self.token_logprobs.append(lp)
            self.top_logprobs.append({token_name(t): v for t, v in top.items()})
            self.text_offset.append(offset)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    chars: int = 0
    chat_logprobs: list[dict[str, Any]] = field(default_factory=list)
    cmpl_logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    finish: str | None = None


class Collected:
    """The frames of one or more jobs, kept per choice until they end: a whole response."""

    def __init__(self, choices: int, logprobs: bool) -> None:
        self.choices = [_Choice() for _ in range(choices)]
        self.logprobs = logprobs
        self.usage: Usage | None = None

    def tokens(self, frame: TokensFrame, base: int = 0) -> None:
        c = self.choices[base + frame.index]
        c.token_ids.extend(frame.token_ids)
        if self.logprobs:
            c.chat_logprobs.extend(chat_logprobs(frame))
            c.cmpl_logprobs.add(frame, c.chars)
        if frame.text:
            c.text.append(frame.text)
            c.chars += len(frame.text)

    def final(self, frame: FinalFrame, base: int = 0) -> None:
        for choice in frame.choices:
            self.choices[base + choice.index].finish = finish_reason(choice.finish_reason)
        self.usage = add_usage(self.usage, frame.usage)

    def chat(self, rid: str, created: int, model: str, tool_plan: tools.ToolPlan) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            content, calls = tools.calls(tool_plan, text)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            finish = c.finish or "stop"
            if calls:
                message["tool_calls"] = tools.openai_calls(calls)
                finish = tool_finish(tool_plan.mode, finish)
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": {"content": c.chat_logprobs} if self.logprobs else None,
                    "finish_reason": finish,
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(self.usage) if self.usage else None,
        }

    def completion(self, rid: str, created: int, model: str, *, token_ids: bool = False) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            choice: dict[str, Any] = {
                "index": i,
                "text": "".join(c.text),
                "logprobs": c.cmpl_logprobs.as_dict() if self.logprobs else None,
                "finish_reason": c.finish or "stop",
            }
            if token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(self.usage) if self.usage else None,
        }
