"""A finished job's stored Result as the response the gateway gives for the same request: the
Result's output cut back into the token frames that carried it, and read like a live stream."""

from __future__ import annotations

from typing import Any

from ..errors import RequestFailed
from ..producer.completion import check_result
from ..schemas import ChoiceLogprobs, ErrorCode, Result, TokensFrame
from .endpoints import CHAT, Prepared, response_id
from .errors import from_code
from .responses import Collected
from .translate import param_of


def frames(result: Result) -> list[TokensFrame]:
    """The token frames of `result`, as far as it tells them apart: one per choice, or, with
    log-probabilities, one per run of tokens whose frame began at the same place in the text
    (what a completion's `text_offset` depends on)."""
    out: list[TokensFrame] = []
    for index, ids in enumerate(result.token_ids):
        text = result.text[index] if result.text and index < len(result.text) else None
        kept = result.logprobs[index] if result.logprobs and index < len(result.logprobs) else None
        if kept is None:
            if ids or text:
                out.append(TokensFrame(seq=0, index=index, token_ids=ids, text=text))
            continue
        out.extend(_split(index, ids, text, kept))
    return out


def _split(index: int, ids: list[int], text: str | None, kept: ChoiceLogprobs) -> list[TokensFrame]:
    offsets = kept.text_offsets if len(kept.text_offsets) == len(ids) else [0] * len(ids)
    out = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end < len(ids) and offsets[end] == offsets[start]:
            continue
        upto = offsets[end] if end < len(ids) else None
        out.append(
            TokensFrame(
                seq=0,
                index=index,
                token_ids=ids[start:end],
                text=text[offsets[start] : upto] if text is not None else None,
                logprobs=kept.logprobs[start:end],
                top_logprobs=kept.top_logprobs[start:end],
            )
        )
        start = end
    return out


def response(prepared: Prepared, result: Result, created: int) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) the gateway answers for the prepared request that ended with `result`;
    a 500 `internal` saying what does not fit for a Result that does not fit the request (more
    choices than it has, per-choice lists of unequal length, a choice its final frame misses or
    names twice): the request log is outside input, so that is one line's error, not the batch's."""
    job = prepared.job
    if result.final is None:
        err = result.error
        failure = (
            from_code(err.code, err.message, param=param_of(err.field, job.params))
            if err is not None
            else from_code(ErrorCode.INTERNAL, "the request ended without an output")
        )
        return failure.status, failure.body()
    req = job.request
    try:  # the log is outside input: a Result that does not fit the request is its line's error
        check_result(req.request_id, result, req.sampling.n)
    except RequestFailed as exc:
        failure = from_code(ErrorCode.INTERNAL, exc.remote_message)
        return failure.status, failure.body()
    collected = Collected(req.sampling.n, req.output.logprobs is not None)
    for frame in frames(result):
        collected.tokens(frame)
    collected.final(result.final)
    rid = response_id(prepared.endpoint, req.request_id)
    body = prepared.body
    if prepared.endpoint == CHAT:
        return 200, collected.chat(rid, created, body.model, job.tool_plan)
    token_ids = getattr(body, "return_token_ids", False)
    return 200, collected.completion(rid, created, body.model, token_ids=token_ids)
