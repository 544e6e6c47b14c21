"""A batch's output and error files, built from its lines' results as the gateway would answer
each line's body."""

from __future__ import annotations

import time

import msgspec

from ..openai import stored
from ..openai.endpoints import prepare
from ..openai.errors import OpenAIError
from ..schemas import Result
from . import plan
from .lines import InputLine, line_request_id

_encoder = msgspec.json.Encoder()


def output_files(batch_id: str) -> tuple[str, str]:
    """Ids of a batch's output and error files: fixed, so a runner that finalizes again after a
    crash overwrites what an earlier one wrote instead of leaving a second copy."""
    tail = batch_id.removeprefix("batch_")
    return f"file-{tail}-output", f"file-{tail}-errors"


def output_lines(
    batch_id: str, lines: list[InputLine], outcomes: dict[int, Result], endpoint: str, stop: plan.Stop
) -> tuple[list[bytes], list[bytes]]:
    """Lines of the output file (responses with status 200) and of the error file (the rest),
    in input order: every input line is in exactly one of them. Run in a thread: each line's
    body is translated again, to read its result as the gateway would."""
    out: list[bytes] = []
    errors: list[bytes] = []
    created = int(time.time())
    for line in lines:
        rid = line_request_id(batch_id, line.line)
        entry: dict = {
            "id": f"batch_req_{rid}",
            "custom_id": line.custom_id,
            "response": None,
            "error": None,
        }
        result = outcomes.get(line.line)
        if result is None:
            entry["error"] = {
                "code": plan.UNRUN_CODE[stop],
                "message": f"the batch stopped ({stop}) first",
            }
            errors.append(_encoder.encode(entry) + b"\n")
            continue
        status, body = _response(endpoint, line, rid, result, created)
        entry["response"] = {"status_code": status, "request_id": rid, "body": body}
        (out if status == 200 else errors).append(_encoder.encode(entry) + b"\n")
    return out, errors


def _response(endpoint: str, line: InputLine, rid: str, result: Result, created: int) -> tuple[int, dict]:
    """The line's response: what the gateway answers for its body, from the line's result."""
    try:
        prepared = prepare(endpoint, line.body, rid)
    except OpenAIError as err:
        return err.status, err.body()
    return stored.response(prepared, result, created)
