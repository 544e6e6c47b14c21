"""A batch's input file, checked whole before anything runs: a bad line fails the batch at
creation with a 400 naming the line, not hours later in the middle of a run."""

from __future__ import annotations

from typing import Any

import msgspec

from ..openai.endpoints import prepare
from ..openai.errors import OpenAIError
from ..subjects import codec

_json = codec.Decoder(Any)
"""Invalid UTF-8 and too deep nesting are a DecodeError like any other bad JSON."""

MAX_LINES = 50_000
"""Requests in one batch, OpenAI's limit: a runner holds every line and its result until the
batch ends, so a file of tiny lines must not make that unbounded."""


class InputLine(msgspec.Struct, frozen=True):
    line: int
    """1-based line number in the file (blank lines count)."""
    custom_id: str
    body: dict[str, Any]


class BadInput(ValueError):
    """The input file cannot run; `line` is 1-based, `param` the field (OpenAI's `param`)."""

    def __init__(self, message: str, *, line: int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.param = param


def line_request_id(batch_id: str, line: int) -> str:
    """The job's request id: the same for a line whichever runner submits it, so a resumed
    runner finds the line's result (or its job, as a duplicate) instead of running it again."""
    return f"{batch_group(batch_id)}-{line}"


def batch_group(batch_id: str) -> str:
    """The batch as a request id (its lines' ids begin with it): the group of its shards, whose
    durable cancel stops every shard of the batch, whichever runner queued it."""
    return batch_id.replace("_", "-")


def in_body(param: str | None) -> str:
    """A body's parameter as a field of its line (OpenAI's `param` for a line: `body.temperature`)."""
    return f"body.{param}" if param else "body"


def parse_input(data: bytes, endpoint: str) -> list[InputLine]:
    """Every request of the file, in order; raises BadInput naming the first bad line."""
    lines: list[InputLine] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        where = f"line {n}"
        if len(lines) == MAX_LINES:
            raise BadInput(
                f"{where}: a batch takes at most {MAX_LINES} requests; split the file into several batches",
                line=n,
            )
        try:
            obj = _json.decode(raw, "json")
        except msgspec.DecodeError as exc:
            raise BadInput(f"{where} is not valid JSON: {exc}", line=n) from None
        if not isinstance(obj, dict):
            raise BadInput(f"{where} must be a JSON object", line=n)
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise BadInput(f"{where}: custom_id must be a non-empty string", line=n, param="custom_id")
        if custom_id in seen:
            raise BadInput(
                f"{where}: custom_id {custom_id!r} is already used on line {seen[custom_id]}; "
                "every line needs its own",
                line=n,
                param="custom_id",
            )
        seen[custom_id] = n
        if obj.get("method") != "POST":
            raise BadInput(f'{where}: method must be "POST"', line=n, param="method")
        if obj.get("url") != endpoint:
            raise BadInput(
                f"{where}: url must be the batch's endpoint {endpoint!r}, got {obj.get('url')!r}",
                line=n,
                param="url",
            )
        unknown = set(obj) - {"custom_id", "method", "url", "body"}
        if unknown:
            raise BadInput(f"{where}: unknown field {sorted(unknown)[0]!r}", line=n, param=sorted(unknown)[0])
        _check_body(endpoint, obj.get("body"), n)
        lines.append(InputLine(n, custom_id, obj["body"]))
    if not lines:
        raise BadInput("the input file has no requests")
    return lines


def _check_body(endpoint: str, body: Any, n: int) -> None:
    """The line's body translated as the runner will translate it, so it fails now if ever."""
    where = f"line {n}"
    try:
        prepare(endpoint, body, line_request_id("batch_0", n))
    except OpenAIError as exc:
        raise BadInput(f"{where}, body: {exc.message}", line=n, param=in_body(exc.param)) from None
    except RecursionError:  # decoded at the edge of the limit, re-encoded a little deeper
        raise BadInput(f"{where}, body: nests too deeply; flatten it", line=n, param="body") from None
