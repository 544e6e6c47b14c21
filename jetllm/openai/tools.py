"""Tools: what `tool_choice` asks of the output, and the model's tool calls read back from its text.

The parser reads Hermes-style blocks, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
which Hermes, Qwen 2.5/3 and many fine-tunes emit. A named function or "required" is enforced the
way vLLM's server does it: a JSON-schema constraint on the output (the arguments object for a named
function; a non-empty array of `{name, parameters}` for "required"), parsed back here.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..schemas import JsonSchemaOutput, ToolFunction, ToolSpec
from .bodies import NamedToolChoice, Tool
from .errors import invalid

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN_TAG = "<tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str
    """JSON text, as OpenAI's `function.arguments`."""


@dataclass(frozen=True)
class ToolPlan:
    """How a request's output becomes tool calls: `mode` is none, auto, named or required."""

    mode: str
    named: str | None = None
    constraint: JsonSchemaOutput | None = None


def specs(tools: list[Tool]) -> list[ToolSpec]:
    out = []
    for i, t in enumerate(tools):
        if t.type != "function":
            raise invalid(f"tools[{i}].type {t.type!r} is not supported; only 'function'", f"tools[{i}].type")
        f = t.function
        out.append(
            ToolSpec(function=ToolFunction(name=f.name, description=f.description, parameters=f.parameters))
        )
    return out


def plan(tools: list[Tool] | None, choice: str | NamedToolChoice | None) -> ToolPlan:
    if not tools:
        if choice in (None, "none", "auto"):
            return ToolPlan("none")
        raise invalid("tool_choice names a tool, but the request has no tools", "tool_choice")
    if choice is None or choice == "auto":
        return ToolPlan("auto")
    if choice == "none":
        return ToolPlan("none")
    if choice == "required":
        return ToolPlan("required", constraint=JsonSchemaOutput(json_schema=_required_schema(tools)))
    assert isinstance(choice, NamedToolChoice)
    for t in tools:
        if t.function.name == choice.function.name:
            params = t.function.parameters or {"type": "object"}
            return ToolPlan("named", named=t.function.name, constraint=JsonSchemaOutput(json_schema=params))
    raise invalid(
        f"tool_choice names {choice.function.name!r}, which is not among the request's tools",
        "tool_choice.function.name",
    )


def _required_schema(tools: list[Tool]) -> dict[str, Any]:
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [t.function.name]},
                        "parameters": t.function.parameters or {"type": "object"},
                    },
                    "required": ["name", "parameters"],
                }
                for t in tools
            ],
        },
    }


def parse_hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    """The text outside the tool-call blocks (None when nothing but blocks) and the calls.
    A block that is not a JSON object with a string `name` stays in the text: the caller sees what
    the model wrote rather than losing it."""
    calls: list[ParsedCall] = []
    kept: list[str] = []
    last = 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def _call(raw: str) -> ParsedCall | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_required(text: str) -> list[ParsedCall]:
    """The calls of a "required" output (a JSON array of `{name, parameters}`); none if unreadable."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    return [
        ParsedCall(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False))
        for i in items
        if isinstance(i, dict) and isinstance(i.get("name"), str)
    ]


def calls(tool_plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedCall]]:
    """Content and tool calls of one choice's finished text, as `tool_plan` reads it."""
    if tool_plan.mode == "named":
        assert tool_plan.named is not None
        return None, [ParsedCall(tool_plan.named, text)]
    if tool_plan.mode == "required":
        found = parse_required(text)
        return (None, found) if found else (text, [])
    if tool_plan.mode == "auto":
        return parse_hermes(text)
    return text, []


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_calls(found: list[ParsedCall]) -> list[dict[str, Any]]:
    return [
        {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in found
    ]
