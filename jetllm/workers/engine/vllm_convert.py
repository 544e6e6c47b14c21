"""jetllm's requests as vLLM's inputs, and vLLM's outputs as jetllm's engine steps: the translation
both ways, apart from the engine's lifecycle (vllm_engine.py). vLLM is imported inside each
function, so a process that never starts an engine never imports it."""

from __future__ import annotations

from typing import Any

from ...errors import RequestRejected
from ...schemas import ErrorCode, FinishReason, GenerateRequest
from . import structured
from .base import ChoiceDelta, EngineAdapter, EngineStep, PromptEmbeds

FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "cancelled",
    "error": "error",
    "repetition": "repetition",
}


def fast_decode(llm: Any) -> Any:
    """The tokenizer's decode when vLLM detokenizes with its fast (DecodeStream) detokenizer,
    the one that leaks a prompt ending inside a character (prompttail.py); else None."""
    try:
        from vllm.v1.engine.detokenizer import uses_fast_detokenizer

        tok = llm.get_tokenizer()
        return tok.decode if uses_fast_detokenizer(tok) else None
    except Exception:
        return None


def lora_request(adapter: EngineAdapter | None) -> Any:
    """vLLM's request to use (or load) an adapter; None for the base model."""
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.id, adapter.path)


def embeds_of(p: PromptEmbeds) -> Any:
    """vLLM's embeddings input; a continuation after a move is mixed mode: the engine embeds the
    token-id positions itself (their rows in the tensor are placeholders)."""
    import torch
    from vllm.inputs import embeds_input

    tensor = torch.from_numpy(p.array)
    if p.dtype == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    if not p.continuation:
        return embeds_input(tensor)
    k = len(p.continuation)
    tensor = torch.cat([tensor, torch.zeros(k, p.hidden, dtype=tensor.dtype)])
    return embeds_input(
        tensor, prompt_token_ids=[0] * p.rows + p.continuation, is_token_ids=[False] * p.rows + [True] * k
    )


def uncompiled(req: GenerateRequest) -> RequestRejected:
    """vLLM checks a constraint when the request is added, without the tokenizer, and compiles it
    in the engine later; a compilation that fails there ends the request with an error and no
    reason (e.g. a grammar naming a special token this tokenizer lacks)."""
    assert req.structured is not None
    return RequestRejected(
        ErrorCode.INVALID_REQUEST,
        "the engine could not compile the constraint for this model's tokenizer (a grammar naming "
        "a token it does not have, say); the worker's log has the compiler's message",
        field=structured.field_of(req.structured),
    )


def step_of(out: Any, want_text: bool) -> EngineStep:
    """One vLLM RequestOutput (a delta) as the engine step the worker's roles read."""
    choices = []
    for c in out.outputs:
        logprobs = top = None
        if c.logprobs:
            logprobs, top = [], []
            for tid, entry in zip(c.token_ids, c.logprobs, strict=False):
                logprobs.append(float(entry[tid].logprob) if tid in entry else float("nan"))
                top.append({int(k): float(v.logprob) for k, v in entry.items()})
        reason = FINISH.get(c.finish_reason) if c.finish_reason else None
        choices.append(
            ChoiceDelta(
                index=c.index,
                token_ids=list(c.token_ids),
                text=c.text if want_text else None,
                logprobs=logprobs,
                top_logprobs=top,
                finish_reason=reason,
                stop_reason=c.stop_reason,
            )
        )
    return EngineStep(
        choices=choices,
        finished=out.finished,
        cached_tokens=out.num_cached_tokens or 0,
        kv_params=getattr(out, "kv_transfer_params", None),
    )
