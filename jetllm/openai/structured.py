"""`response_format` and vLLM's guided-decoding extras, as the job's structured-output constraint."""

from __future__ import annotations

import json
from typing import Any

from ..schemas import (
    ChoiceOutput,
    GrammarOutput,
    JsonObjectOutput,
    JsonSchemaOutput,
    RegexOutput,
    StructuredOutput,
)
from .bodies import ResponseFormat, StructuredOutputs, _Generation
from .errors import invalid


def _schema(value: dict[str, Any] | str, param: str) -> JsonSchemaOutput:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise invalid(f"{param} is not valid JSON: {exc}", param) from None
        except RecursionError:
            raise invalid(f"{param} nests too deeply; flatten it", param) from None
    if not isinstance(value, dict):
        raise invalid(f"{param} must be a JSON schema (an object)", param)
    return JsonSchemaOutput(json_schema=value)


def from_response_format(fmt: ResponseFormat) -> StructuredOutput | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JsonObjectOutput()
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise invalid(
                "response_format of type json_schema needs json_schema.schema", "response_format.json_schema"
            )
        return _schema(fmt.json_schema.schema, "response_format.json_schema.schema")
    raise invalid(
        f"response_format.type {fmt.type!r} is not one of text, json_object, json_schema",
        "response_format.type",
    )


def from_structured_outputs(so: StructuredOutputs) -> list[tuple[str, StructuredOutput]]:
    found: list[tuple[str, StructuredOutput]] = []
    if so.json is not None:
        found.append(("structured_outputs.json", _schema(so.json, "structured_outputs.json")))
    if so.regex is not None:
        found.append(("structured_outputs.regex", RegexOutput(pattern=so.regex)))
    if so.choice is not None:
        found.append(("structured_outputs.choice", ChoiceOutput(choices=so.choice)))
    if so.grammar is not None:
        found.append(("structured_outputs.grammar", GrammarOutput(grammar=so.grammar)))
    if so.json_object:
        found.append(("structured_outputs.json_object", JsonObjectOutput()))
    return found


def constraint(body: _Generation) -> tuple[str, StructuredOutput] | None:
    """The one constraint the body asks for, with the parameter that asked; two are a 400."""
    found: list[tuple[str, StructuredOutput]] = []
    if body.response_format is not None:
        got = from_response_format(body.response_format)
        if got is not None:
            found.append(("response_format", got))
    if body.guided_json is not None:
        found.append(("guided_json", _schema(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        found.append(("guided_regex", RegexOutput(pattern=body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", ChoiceOutput(choices=body.guided_choice)))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", GrammarOutput(grammar=body.guided_grammar)))
    if body.structured_outputs is not None:
        found.extend(from_structured_outputs(body.structured_outputs))
    if len(found) > 1:
        names = ", ".join(p for p, _ in found)
        raise invalid(f"only one output constraint may be given; this request has {names}", found[1][0])
    return found[0] if found else None
