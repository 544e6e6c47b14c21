"""`jetllm lora push|load|unload|list`: adapter files into the object store, and the set of
adapters a model serves (every instance answers for itself)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import msgspec

from ..aio import run
from ..errors import JetllmError
from ..producer.lora import FanOut, LoraAdmin
from ..schemas import AdapterList, AdapterReply, AdapterSource, ControlFailed
from ..subjects.connection import connect
from ..subjects.names import Names
from ..subjects.server import check_server
from .common import add_nats, nats_url


async def _admin(args: argparse.Namespace, fn) -> int:
    nc = await connect(nats_url(args))
    try:
        await check_server(nc)
        return await fn(LoraAdmin(nc, Names(args.namespace), timeout=args.timeout))
    except JetllmError as exc:  # a bad name or spec, an adapter never pushed, unusable files
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        await nc.close()


def _report(out: FanOut, as_json: bool) -> int:
    if as_json:
        for r in out.replies:
            print(msgspec.json.encode(r).decode())
    for r in out.replies:
        if as_json:
            continue
        if isinstance(r, ControlFailed):
            print(f"{r.instance}: FAILED {r.code.value}: {r.message}")
        elif isinstance(r, AdapterReply):
            a = r.adapter
            extra = f" (sha256 {a.sha256[:12]}, lora id {a.lora_id}, version {a.version})" if a else ""
            print(f"{r.instance}: {r.action} {r.name}{extra}")
        elif isinstance(r, AdapterList):
            names = ", ".join(f"{a.name}@{a.sha256[:12]}" for a in r.adapters) or "no adapters"
            print(f"{r.instance}: {names} ({len(r.adapters)}/{r.capacity})")
            for name, why in r.failed.items():
                print(f"{r.instance}:   not loaded {name}: {why}")
    for m in out.missing:
        print(f"{m}: no answer in time", file=sys.stderr)
    if not out.replies:
        print("no instance answered", file=sys.stderr)
    if out.rolled_back:
        print("every instance failed: the desired state was put back as it was", file=sys.stderr)
    return 1 if out.failed or out.missing or not out.replies else 0


async def _push(args: argparse.Namespace) -> int:
    async def go(admin: LoraAdmin) -> int:
        m = await admin.push(Path(args.directory), args.name)
        print(json.dumps(msgspec.to_builtins(m)))
        return 0

    return await _admin(args, go)


async def _load(args: argparse.Namespace) -> int:
    source: AdapterSource
    if args.path:
        source, ref = "path", args.path if args.remote_path else os.path.abspath(args.path)
    elif args.object:
        source, ref = "object", args.object
    else:
        source, ref = "hub", args.hub

    async def go(admin: LoraAdmin) -> int:
        out = await admin.load(args.model, args.name, source=source, ref=ref, instance=args.instance)
        return _report(out, args.json)

    return await _admin(args, go)


async def _unload(args: argparse.Namespace) -> int:
    async def go(admin: LoraAdmin) -> int:
        return _report(await admin.unload(args.model, args.name, instance=args.instance), args.json)

    return await _admin(args, go)


async def _list(args: argparse.Namespace) -> int:
    async def go(admin: LoraAdmin) -> int:
        if args.desired:
            for spec in await admin.desired(args.model):
                print(msgspec.json.encode(spec).decode())
            return 0
        return _report(await admin.list(args.model, instance=args.instance), args.json)

    return await _admin(args, go)


def _common(v: argparse.ArgumentParser, model: bool = True) -> None:
    add_nats(v)
    if model:
        v.add_argument("--model", required=True, help="the base model whose workers serve the adapter")
        v.add_argument(
            "--instance",
            default=None,
            help="wait for this one instance's answer only (the desired state stays model-wide)",
        )
        v.add_argument("--json", action="store_true", help="one JSON reply per line")
    v.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the instances' answers")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lora",
        help="push, load, unload and list LoRA adapters",
        description="LoRA adapters: files in the object store, and the adapters each model serves.",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)

    v = verbs.add_parser(
        "push",
        help="upload an adapter directory to the adapters object store",
        description="Upload adapter_config.json and adapter_model.safetensors under their content "
        "hash and name them; load them with `jetllm lora load --object NAME`.",
    )
    _common(v, model=False)
    v.add_argument("directory", help="the adapter directory")
    v.add_argument("--name", required=True, help="the adapter's name")
    v.set_defaults(func=lambda a: run(_push, a))

    v = verbs.add_parser(
        "load",
        help="make a model serve an adapter, on every instance",
        description="Add the adapter to the model's desired set; every instance loads it (and "
        "instances started later too) and answers with what it did.",
    )
    _common(v)
    v.add_argument("name", help="the adapter's name (requests name it in `adapter`)")
    src = v.add_mutually_exclusive_group(required=True)
    src.add_argument("--path", help="a directory on the workers, inside one of their --lora-dir")
    src.add_argument("--object", help="an adapter pushed with `jetllm lora push`")
    src.add_argument("--hub", help="a hub repository id (workers need --lora-allow-hub and network access)")
    v.add_argument(
        "--remote-path", action="store_true", help="pass --path as given (do not make it absolute here)"
    )
    v.set_defaults(func=lambda a: run(_load, a))

    v = verbs.add_parser(
        "unload",
        help="stop serving an adapter, on every instance",
        description="Remove the adapter from the model's desired set; every instance unloads it.",
    )
    _common(v)
    v.add_argument("name", help="the adapter's name")
    v.set_defaults(func=lambda a: run(_unload, a))

    v = verbs.add_parser(
        "list",
        help="the adapters each instance holds",
        description="Every instance of the model lists its adapters and the ones it failed to load.",
    )
    _common(v)
    v.add_argument("--desired", action="store_true", help="print the desired set (the bucket) instead")
    v.set_defaults(func=lambda a: run(_list, a))
