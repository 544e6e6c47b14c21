"""Chat messages as chat templates read them."""

from __future__ import annotations

import json
from typing import Any

from ...schemas import ChatMessage


def template_message(m: ChatMessage) -> dict[str, Any]:
    """The message as a dict for the template. Tool-call arguments travel as JSON text (OpenAI's
    shape), but templates iterate them as a mapping (`arguments | items`), so a JSON object is
    given to them parsed; anything else stays the text it was."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls is not None:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": c.type,
                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
