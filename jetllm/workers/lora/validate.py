"""Checks an adapter's files against the base model before the engine sees them.

vLLM loads an adapter in its engine process; files it cannot use there fail the load (safely,
for `add_lora`), but shapes that do not match the model, a rank above the engine's limit or a
truncated file are cheaper and clearer to refuse here, with a message that says what is wrong.
"""

from __future__ import annotations

import re
from pathlib import Path

from ...adapterfiles import (
    CONFIG,
    WEIGHTS,
    AdapterFileError,
    check_present,
    read_config,
    read_safetensors_header,
    short,
)
from ...schemas import ErrorCode
from ..engine import LoraFacts

_KEY = re.compile(
    r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:[A-Za-z_]+\.)*?([A-Za-z_]+)\.lora_([AB])\.weight$"
)
_MAX_LAYER_DIGITS = 9
"""A layer index longer than this is out of range for any model (and int() refuses 4300+ digits)."""


def _invalid(message: str) -> AdapterFileError:
    return AdapterFileError(message, code=ErrorCode.ADAPTER_INVALID)


def _leaf(name: str) -> str:
    return name.rsplit("/", 1)[-1].lower()


def check_config(config: dict, facts: LoraFacts) -> tuple[int, set[str]]:
    """(rank, target modules) of a PEFT LoRA config this engine can run."""
    if config.get("peft_type", "LORA") != "LORA":
        raise _invalid(
            f"{CONFIG}: peft_type is {config.get('peft_type')!r}, only LORA adapters are supported"
        )
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _invalid(f"{CONFIG}: r (the rank) must be a positive integer, got {rank!r}")
    if rank > facts.max_rank:
        raise _invalid(f"{CONFIG}: rank {rank} exceeds this worker's --max-lora-rank {facts.max_rank}")
    if not isinstance(config.get("lora_alpha", rank), (int, float)):
        raise _invalid(f"{CONFIG}: lora_alpha must be a number")
    for flag in ("use_dora", "use_rslora_bias"):
        if config.get(flag):
            raise _invalid(f"{CONFIG}: {flag} is not supported")
    if config.get("modules_to_save"):
        raise _invalid(f"{CONFIG}: modules_to_save is not supported (the adapter must only add LoRA weights)")
    if config.get("bias", "none") != "none":
        raise _invalid(f"{CONFIG}: bias must be 'none', got {config.get('bias')!r}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise _invalid(f"{CONFIG}: target_modules must be a non-empty list of module names")
    unknown = sorted(set(targets) - set(facts.modules))
    if unknown:
        raise _invalid(f"{CONFIG}: unknown target modules {unknown}; this model has {sorted(facts.modules)}")
    base = config.get("base_model_name_or_path")
    if base and facts.base_names and _leaf(str(base)) not in {_leaf(n) for n in facts.base_names}:
        raise _invalid(
            f"{CONFIG}: the adapter was made for {base!r}, this worker serves {facts.base_names[0]!r}"
        )
    return rank, set(targets)


def check_weights(
    tensors: dict[str, tuple[str, list[int]]], rank: int, targets: set[str], facts: LoraFacts
) -> None:
    pairs: dict[tuple[int, str], set[str]] = {}
    for key, (_, shape) in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise _invalid(
                f"{WEIGHTS}: unexpected tensor {short(key)} (only lora_A/lora_B weights of the target "
                "modules are allowed)"
            )
        digits, module, which = m.group(1), m.group(2), m.group(3)
        if module not in targets:
            raise _invalid(
                f"{WEIGHTS}: tensor {short(key)} adapts {module!r}, which is not in target_modules"
            )
        if len(digits) > _MAX_LAYER_DIGITS:
            raise _invalid(
                f"{WEIGHTS}: tensor {short(key)} has a layer index of {len(digits)} digits; "
                f"the model has {facts.num_layers} layers"
            )
        layer = int(digits)
        if layer >= facts.num_layers:
            raise _invalid(
                f"{WEIGHTS}: tensor {short(key)} is for layer {layer}; the model has {facts.num_layers}"
            )
        fan_in, fan_out = facts.modules[module]
        want = [rank, fan_in] if which == "A" else [fan_out, rank]
        if shape != want:
            raise _invalid(f"{WEIGHTS}: tensor {short(key)} has shape {shape}, this model needs {want}")
        pairs.setdefault((layer, module), set()).add(which)
    half = sorted(f"layer {layer} {module}" for (layer, module), got in pairs.items() if got != {"A", "B"})
    if half:
        raise _invalid(f"{WEIGHTS}: lora_A and lora_B must come in pairs; incomplete: {', '.join(half[:5])}")


def validate(directory: Path, facts: LoraFacts) -> int:
    """The adapter's rank, or AdapterFileError saying why the engine must not see it."""
    check_present(directory)
    rank, targets = check_config(read_config(directory / CONFIG), facts)
    check_weights(read_safetensors_header(directory / WEIGHTS), rank, targets, facts)
    return rank
