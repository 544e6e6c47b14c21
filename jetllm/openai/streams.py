"""Stream chunks of OpenAI responses, from jetllm's token and final frames as they arrive."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..schemas import FinalFrame, TokensFrame, Usage
from . import tools
from .responses import CompletionLogprobs, chat_logprobs, finish_reason, tool_finish, usage


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


class _Chunks:
    """What every chunk of one response shares; `usage` is present (null) on each when the client
    asked for usage, and set on the last."""

    kind = ""

    def __init__(self, rid: str, created: int, model: str, *, include_usage: bool) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.include_usage = include_usage

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.rid,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, u: Usage) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage(u)
        return chunk


class ChatStream(_Chunks):
    """Chunks of a streamed chat completion. Plain text streams as it comes; with tools in "auto",
    text streams until a `<tool_call>` tag begins, and the calls follow as one chunk at the end; a
    named function streams its arguments as they come; "required" sends its calls at the end."""

    kind = "chat.completion.chunk"

    def __init__(
        self, rid: str, created: int, model: str, n: int, tool_plan: tools.ToolPlan, *, include_usage: bool
    ) -> None:
        super().__init__(rid, created, model, include_usage=include_usage)
        self.tool_plan = tool_plan
        self.choices = [_StreamChoice() for _ in range(n)]

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
                    finish = tool_finish(self.tool_plan.mode, finish)
                out.append(self._chunk([self._delta(i, delta)]))
            out.append(self._chunk([self._delta(i, {}, finish=finish)]))
        return out


class CompletionStream(_Chunks):
    """Chunks of a streamed text completion; `base` offsets the choice indexes of one prompt."""

    kind = "text_completion"

    def __init__(
        self, rid: str, created: int, model: str, *, include_usage: bool, token_ids: bool = False
    ) -> None:
        super().__init__(rid, created, model, include_usage=include_usage)
        self.token_ids = token_ids
        self.chars: dict[int, int] = {}

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
