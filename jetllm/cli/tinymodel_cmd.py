"""`jetllm make-tiny-model` and `jetllm make-tiny-lora`: the deterministic tiny model and its
adapters, built offline for tests and demos."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from .. import tinymodel

    out = tinymodel.build(Path(args.directory), seed=args.seed)
    print(out)
    return 0


def cmd_make_tiny_lora(args: argparse.Namespace) -> int:
    from .. import tinymodel

    print(tinymodel.build_lora(Path(args.directory), seed=args.seed, rank=args.rank))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-tiny-model",
        help="build the deterministic tiny test model",
        description="Build a tiny random Llama with tokenizer and chat template, offline.",
    )
    p.add_argument("directory", help="where to write it")
    p.add_argument("--seed", type=int, default=0, help="weights seed (the same seed gives the same model)")
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser(
        "make-tiny-lora",
        help="build a LoRA adapter for the tiny test model",
        description="Write a PEFT-format LoRA adapter (q_proj, v_proj) for the tiny model, offline.",
    )
    p.add_argument("directory", help="where to write it")
    p.add_argument(
        "--seed", type=int, default=1, help="weights seed (different seeds give different adapters)"
    )
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.set_defaults(func=cmd_make_tiny_lora)
