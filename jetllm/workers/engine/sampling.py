"""From a GenerateRequest to vLLM SamplingParams, with vLLM's own validation mapped to fields."""

from __future__ import annotations

import re
from typing import Any

from ...errors import RequestRejected
from ...schemas import ErrorCode, GenerateRequest, TokensPrompt
from . import structured

_FIELDS = {
    **{
        name: f"$.sampling.{name}"
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "n",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
    },
    **{
        name: f"$.stop.{name}"
        for name in ("max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos")
    },
    "logprobs": "$.output.logprobs",
    "prompt": "$.prompt",
}
_LEADING_NAME = re.compile(r"^`?(\w+)`? (?:must|should|cannot|is)")
_ABOUT_A_CONSTRAINT = re.compile(
    r"structured|grammar|regex|json|schema|choice|xgrammar|guidance|outlines", re.I
)
_MODEL_DEFAULTED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def field_of(parameter: str | None, message: str = "") -> str | None:
    """Our field path for a vLLM parameter name (or, lacking one, the name a message starts with)."""
    if parameter is None:
        m = _LEADING_NAME.match(message)
        parameter = m.group(1) if m and m.group(1) in _FIELDS else None
    if parameter is None:
        return None
    return _FIELDS.get(parameter, f"$.{parameter}")


def field_of_error(req: GenerateRequest, parameter: str | None, message: str) -> str | None:
    """The field a vLLM validation error is about. vLLM names no parameter for a constraint that
    does not compile, so an unnamed error about one, on a request that has one, is its field."""
    field = field_of(parameter, message)
    if field is None and req.structured is not None and _ABOUT_A_CONSTRAINT.search(message):
        return structured.field_of(req.structured)
    return field


DETACHED_STREAM_INTERVAL = 32
"""Tokens per engine output for a detached job that names none (OutputOptions.stream_interval)."""


def stream_interval(req: GenerateRequest) -> int | None:
    if req.output.stream_interval is not None:
        return req.output.stream_interval
    return DETACHED_STREAM_INTERVAL if req.reply_to is None else None


def build_sampling_params(req: GenerateRequest, max_tokens: int, model_defaults: dict[str, Any]) -> Any:
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind

    s, st, out = req.sampling, req.stop, req.output
    kw: dict[str, Any] = {}
    for name in _MODEL_DEFAULTED:
        value = getattr(s, name)
        if value is None:
            value = model_defaults.get(name)
        if value is not None:
            kw[name] = value
    want_text = out.text if out.text is not None else not isinstance(req.prompt, TokensPrompt)
    seed = structured.sampling_seed(req)
    constraint = None
    if req.structured is not None:
        structured.check_bounds(req.structured)
    try:
        if req.structured is not None:
            from vllm.sampling_params import StructuredOutputsParams

            constraint = StructuredOutputsParams(**structured.vllm_kwargs(req.structured))
        return SamplingParams(
            **kw,
            n=s.n,
            seed=seed,
            max_tokens=max_tokens,
            min_tokens=st.min_tokens,
            stop=list(st.stop) or None,
            stop_token_ids=list(st.stop_token_ids) or None,
            ignore_eos=st.ignore_eos,
            include_stop_str_in_output=st.include_stop_str_in_output,
            logprobs=out.logprobs,
            skip_special_tokens=out.skip_special_tokens,
            detokenize=want_text or bool(st.stop),
            output_kind=RequestOutputKind.DELTA,
            stream_interval=stream_interval(req),
            structured_outputs=constraint,
        )
    except VLLMValidationError as exc:
        raise RequestRejected(
            ErrorCode.INVALID_REQUEST,
            str(exc),
            field=field_of_error(req, getattr(exc, "parameter", None), str(exc)),
        ) from None
    except (ValueError, TypeError) as exc:
        raise RequestRejected(
            ErrorCode.INVALID_REQUEST, str(exc), field=field_of_error(req, None, str(exc))
        ) from None
