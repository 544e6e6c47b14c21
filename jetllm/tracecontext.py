"""W3C trace context (`traceparent` header): parsed strictly, since it comes from a message."""

from __future__ import annotations

import re
import secrets

HEADER = "traceparent"
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def new_span_id() -> str:
    return secrets.token_hex(8)


def new_traceparent() -> str:
    return f"00-{secrets.token_hex(16)}-{new_span_id()}-01"


def parse(value: str | None) -> tuple[str, str] | None:
    """(trace id, parent span id), or None for a missing or malformed header (all-zero ids are invalid)."""
    if not value:
        return None
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None or set(m.group(1)) == {"0"} or set(m.group(2)) == {"0"}:
        return None
    return m.group(1), m.group(2)


def child(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"
