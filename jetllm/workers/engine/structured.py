"""A generate job's structured-output constraint: its field, its bounds, and what vLLM is given.

The bounds keep hostile constraints from occupying the engine: vLLM checks a constraint in the
worker's event loop (cheap: parsing only) and compiles it against the vocabulary later, on the
engine's grammar thread, with no time limit for JSON schemas. Compile time grows steeply with the
properties of one object (xgrammar 0.2.8, 512-token vocabulary, one core: 256 optional properties
0.5 s, 512 2.6 s, 2000 95 s), so properties are bounded per object and in total, besides the
schema's size. Regexes and grammars compile lazily and stay fast at their wire limits.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from ...errors import RequestRejected
from ...schemas import (
    ChoiceOutput,
    ErrorCode,
    GenerateRequest,
    GrammarOutput,
    JsonObjectOutput,
    JsonSchemaOutput,
    RegexOutput,
    StructuredOutput,
)

MAX_SCHEMA_BYTES = 64 * 1024
MAX_OBJECT_PROPERTIES = 256
MAX_TOTAL_PROPERTIES = 1024
MAX_SCHEMA_DEPTH = 64
"""vLLM's own limit on objects and arrays nested in a schema, checked here before walking it."""
MAX_CHOICES_CHARS = 64 * 1024


def field_of(structured: StructuredOutput) -> str:
    """Where a problem with the constraint is, for the error that names it."""
    if isinstance(structured, JsonSchemaOutput):
        return "$.structured.json_schema"
    if isinstance(structured, RegexOutput):
        return "$.structured.pattern"
    if isinstance(structured, ChoiceOutput):
        return "$.structured.choices"
    if isinstance(structured, GrammarOutput):
        return "$.structured.grammar"
    return "$.structured"


def check_bounds(structured: StructuredOutput) -> None:
    """Refuse a constraint the engine could not compile in bounded time; raises RequestRejected."""
    field = field_of(structured)
    if isinstance(structured, ChoiceOutput):
        size = sum(len(c) for c in structured.choices)
        if size > MAX_CHOICES_CHARS:
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST,
                f"the choices hold {size} characters together; at most {MAX_CHOICES_CHARS} are "
                "accepted: shorten them, or use a regex or a grammar",
                field=field,
            )
    if not isinstance(structured, JsonSchemaOutput):
        return
    size = len(msgspec.json.encode(structured.json_schema))
    if size > MAX_SCHEMA_BYTES:
        raise RequestRejected(
            ErrorCode.INVALID_REQUEST,
            f"the JSON schema is {size} bytes as JSON; at most {MAX_SCHEMA_BYTES} are accepted",
            field=field,
        )
    depth, widest, total = _shape(structured.json_schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise RequestRejected(
            ErrorCode.INVALID_REQUEST,
            f"the JSON schema nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep",
            field=field,
        )
    if widest > MAX_OBJECT_PROPERTIES or total > MAX_TOTAL_PROPERTIES:
        raise RequestRejected(
            ErrorCode.INVALID_REQUEST,
            f"the JSON schema declares {widest} properties in one object and {total} in all; at most "
            f"{MAX_OBJECT_PROPERTIES} per object and {MAX_TOTAL_PROPERTIES} in all are accepted (their "
            "compilation time grows steeply): split it, or mark properties required",
            field=field,
        )


def _shape(schema: Any) -> tuple[int, int, int]:
    """(nesting depth, most properties of one `properties` map, properties in all); iterative, so a
    deep schema cannot exhaust the stack, and it stops descending past the depth limit."""
    depth = widest = total = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            depth = max(depth, level)
            if level > MAX_SCHEMA_DEPTH:
                continue
            props = node.get("properties")
            if isinstance(props, dict):
                widest = max(widest, len(props))
                total += len(props)
            stack.extend((v, level + 1) for v in node.values())
        elif isinstance(node, list):
            depth = max(depth, level)
            if level > MAX_SCHEMA_DEPTH:
                continue
            stack.extend((v, level + 1) for v in node)
    return depth, widest, total


def vllm_kwargs(structured: StructuredOutput) -> dict[str, Any]:
    """The arguments of vLLM's StructuredOutputsParams for the constraint."""
    if isinstance(structured, JsonSchemaOutput):
        return {"json": structured.json_schema}
    if isinstance(structured, JsonObjectOutput):
        return {"json_object": True}
    if isinstance(structured, RegexOutput):
        return {"regex": structured.pattern}
    if isinstance(structured, ChoiceOutput):
        return {"choice": list(structured.choices)}
    return {"grammar": structured.grammar}


def sampling_seed(req: GenerateRequest) -> int | None:
    """The seed the engine samples with: the request's own, else for a structured request one
    derived from its request id, else none."""
    if req.sampling.seed is not None or req.structured is None:
        return req.sampling.seed
    return derived_seed(req.request_id)


def derived_seed(request_id: str) -> int:
    """A sampling seed from the request id, for a structured request that gave none: every attempt
    then samples the same tokens, so a continuation can replay what was delivered (continuation.py)."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") >> 1
