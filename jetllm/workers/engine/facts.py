"""What a started vLLM engine tells the worker about itself (EngineFacts): limits, block layout,
end-of-sequence ids, LoRA capacity, KV-event sockets. Read once at start-up from vLLM's config and
tokenizer; budgets, routing hashes and adapter checks use them from then on."""

from __future__ import annotations

import os
from typing import Any

from .base import EngineFacts, KvEventSource, LoraFacts


def engine_facts(llm: Any, name: str, model: str) -> EngineFacts:
    """`name`: the model name jobs use; `model`: the path or hub id it was loaded from."""
    cfg = llm.vllm_config
    try:
        vocab = cfg.model_config.get_vocab_size()
    except Exception:
        vocab = None
    import vllm

    cache = cfg.cache_config
    return EngineFacts(
        model=name,
        max_model_len=llm.model_config.max_model_len,
        block_size=cfg.cache_config.block_size,
        num_kv_blocks=cfg.cache_config.num_gpu_blocks,
        prefix_hash_algo=cache.prefix_caching_hash_algo if cache.enable_prefix_caching else None,
        max_num_seqs=cfg.scheduler_config.max_num_seqs,
        dp_ranks=list(range(cfg.parallel_config.data_parallel_size)),
        vocab_size=vocab,
        eos_token_ids=_eos_token_ids(llm),
        engine=f"vllm {vllm.__version__}",
        source=os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model,
        chat_template=_has_chat_template(llm),
        hidden_size=llm.model_config.get_hidden_size(),
        prompt_embeds=bool(llm.model_config.enable_prompt_embeds),
        lora=_lora_facts(llm, {name, model, os.path.basename(os.path.normpath(model))}),
        kv_events=_kv_event_sources(llm),
    )


def _eos_token_ids(llm: Any) -> list[int]:
    """Every id that ends a sequence: the tokenizer's, the generation config's, the model's."""
    eos: set[int] = set()
    try:
        tok = llm.get_tokenizer()
        if tok.eos_token_id is not None:
            eos.add(int(tok.eos_token_id))
    except Exception:
        pass
    gen_eos = llm.model_config.get_diff_sampling_param().get("stop_token_ids") or []
    eos.update(int(t) for t in gen_eos)
    hf_eos = getattr(llm.model_config.hf_config, "eos_token_id", None)
    if isinstance(hf_eos, int):
        eos.add(hf_eos)
    elif isinstance(hf_eos, list):
        eos.update(int(t) for t in hf_eos)
    return sorted(eos)


def _lora_facts(llm: Any, names: set[str]) -> LoraFacts | None:
    lora = llm.vllm_config.lora_config
    if lora is None:
        return None
    hf = llm.model_config.hf_text_config
    hidden = hf.hidden_size
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hidden // heads
    inter = getattr(hf, "intermediate_size", None)
    modules = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }
    if inter:
        modules.update(gate_proj=(hidden, inter), up_proj=(hidden, inter), down_proj=(inter, hidden))
    return LoraFacts(
        capacity=lora.max_cpu_loras or lora.max_loras,
        max_rank=lora.max_lora_rank,
        num_layers=hf.num_hidden_layers,
        modules=modules,
        base_names=sorted(n for n in names if n),
    )


def _kv_event_sources(llm: Any) -> dict[int, KvEventSource]:
    """The publishers the engine actually bound, per data-parallel rank (ZMQ ones only)."""
    try:
        sources = llm.get_kv_event_sources()
    except Exception:
        return {}
    return {
        int(rank): KvEventSource(endpoint=c.endpoint, replay_endpoint=c.replay_endpoint, topic=c.topic or "")
        for rank, c in sources.items()
        if c.enable_kv_cache_events and c.publisher == "zmq" and c.endpoint
    }


def _has_chat_template(llm: Any) -> bool:
    try:
        return bool(getattr(llm.get_tokenizer(), "chat_template", None))
    except Exception:
        return False
