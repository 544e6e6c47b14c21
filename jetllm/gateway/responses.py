"""jetllm's reply frames as OpenAI response objects: whole responses and stream chunks.

Log-probabilities name tokens as `token_id:<id>` (the form of vLLM's `return_tokens_as_token_ids`):
the gateway has no tokenizer, and the worker sends ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..schemas import FinalFrame, TokensFrame, Usage
from . import tools

_FINISH = {"stop": "stop", "length": "length"}


def finish_reason(reason: str) -> str:
    return _FINISH.get(reason, reason)


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
                finish = "stop" if tool_plan.mode == "named" else "tool_calls"
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


def _held_back(text: str) -> int:
    """How many trailing characters of `text` could begin a `<tool_call>` tag."""
    for k in range(min(len(tools.OPEN_TAG) - 1, len(text)), 0, -1):
        if tools.OPEN_TAG.startswith(text[-k:]):
            return k
    return 0


@dataclass
class _StreamChoice:
    started: bool = False
    held: str = ""
    in_calls: bool = False
    chars: int = 0
    called: bool = False


class ChatStream:
    """Chunks of a streamed chat completion. Plain text streams as it comes; with tools in "auto",
    text streams until a `<tool_call>` tag begins, and the calls follow as one chunk at the end; a
    named function streams its arguments as they come; "required" sends its calls at the end."""

    def __init__(
        self, rid: str, created: int, model: str, n: int, tool_plan: tools.ToolPlan, *, include_usage: bool
    ) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.tool_plan = tool_plan
        self.include_usage = include_usage
        self.choices = [_StreamChoice() for _ in range(n)]

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def _delta(self, index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None):
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _start(self, index: int) -> list[dict[str, Any]]:
        c = self.choices[index]
        if c.started:
            return []
        c.started = True
        return [self._chunk([self._delta(index, {"role": "assistant", "content": ""})])]

    def tokens(self, frame: TokensFrame) -> list[dict[str, Any]]:
        i = frame.index
        out = self._start(i)
        c = self.choices[i]
        text = frame.text or ""
        logprobs = {"content": chat_logprobs(frame)} if frame.logprobs is not None else None
        mode = self.tool_plan.mode
        if mode == "named":
            delta: dict[str, Any] = {}
            if not c.called:
                c.called = True
                delta = {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": tools.call_id(),
                            "type": "function",
                            "function": {"name": self.tool_plan.named, "arguments": text},
                        }
                    ]
                }
            elif text:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
            if delta or logprobs:
                out.append(self._chunk([self._delta(i, delta, logprobs)]))
            return out
        if mode == "required":
            c.held += text
            return out
        if mode == "auto":
            text = self._visible(c, text)
        if text or logprobs:
            out.append(self._chunk([self._delta(i, {"content": text} if text else {}, logprobs)]))
        return out

    def _visible(self, c: _StreamChoice, text: str) -> str:
        if c.in_calls:
            c.held += text
            return ""
        s = c.held + text
        at = s.find(tools.OPEN_TAG)
        if at >= 0:
            c.in_calls, c.held = True, s[at:]
            return s[:at]
        keep = _held_back(s)
        c.held = s[len(s) - keep :] if keep else ""
        return s[: len(s) - keep]

    def final(self, frame: FinalFrame) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for choice in sorted(frame.choices, key=lambda ch: ch.index):
            i = choice.index
            out.extend(self._start(i))
            c = self.choices[i]
            finish = finish_reason(choice.finish_reason)
            if self.tool_plan.mode in ("auto", "required") and c.held:
                content, calls = tools.calls(self.tool_plan, c.held)
                delta: dict[str, Any] = {}
                if content:
                    delta["content"] = content
                if calls:
                    delta["tool_calls"] = [
                        dict(call, index=k) for k, call in enumerate(tools.openai_calls(calls))
                    ]
                    finish = "tool_calls"
                out.append(self._chunk([self._delta(i, delta)]))
            out.append(self._chunk([self._delta(i, {}, finish=finish)]))
        return out

    def usage_chunk(self, u: Usage) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage(u)
        return chunk


class CompletionStream:
    """Chunks of a streamed text completion; `base` offsets the choice indexes of one prompt."""

    def __init__(
        self, rid: str, created: int, model: str, *, include_usage: bool, token_ids: bool = False
    ) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.include_usage = include_usage
        self.token_ids = token_ids
        self.chars: dict[int, int] = {}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def tokens(self, frame: TokensFrame, base: int = 0) -> list[dict[str, Any]]:
        i = base + frame.index
        logprobs = None
        if frame.logprobs is not None:
            lp = CompletionLogprobs()
            lp.add(frame, self.chars.get(i, 0))
            logprobs = lp.as_dict()
        text = frame.text or ""
        self.chars[i] = self.chars.get(i, 0) + len(text)
        if not text and logprobs is None and not self.token_ids:
            return []
        choice: dict[str, Any] = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": None}
        if self.token_ids:
            choice["token_ids"] = frame.token_ids
        return [self._chunk([choice])]

    def final(self, frame: FinalFrame, base: int = 0) -> list[dict[str, Any]]:
        return [
            self._chunk(
                [
                    {
                        "index": base + c.index,
                        "text": "",
                        "logprobs": None,
                        "finish_reason": finish_reason(c.finish_reason),
                    }
                ]
            )
            for c in sorted(frame.choices, key=lambda ch: ch.index)
        ]

    def usage_chunk(self, u: Usage) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage(u)
        return chunk
