"""From a GenerateRequest to vLLM SamplingParams, with vLLM's own validation mapped to fields."""

from __future__ import annotations

import re
from typing import Any

from ...errors import RequestRejected
from ...schemas import ErrorCode, GenerateRequest, TokensPrompt

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
    try:
        return SamplingParams(
            **kw,
            n=s.n,
            seed=s.seed,
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
        )
    except VLLMValidationError as exc:
        raise RequestRejected(
            ErrorCode.INVALID_REQUEST, str(exc), field=field_of(getattr(exc, "parameter", None), str(exc))
        ) from None
    except (ValueError, TypeError) as exc:
        raise RequestRejected(ErrorCode.INVALID_REQUEST, str(exc), field=field_of(None, str(exc))) from None
