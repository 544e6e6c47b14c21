"""How the CLI sets up the prefill and decode roles: the engine's private block directory, and
the prefill worker `jetllm up --disagg` starts beside its decode worker."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from ..spawn import jetllm_command
from ..subjects.connection import redact

DISAGG_ROLES = ("prefill", "decode")


@contextlib.contextmanager
def block_dir(role: str, opts: Any, config: Any) -> Iterator[tuple[Any, Any]]:
    """For the prefill and decode roles: a private directory the engine's KV connector and the
    worker exchange block files in, removed when the worker ends."""
    if role not in DISAGG_ROLES:
        yield opts, config
        return
    import msgspec

    d = tempfile.mkdtemp(prefix="jetllm-kvblocks-")
    try:
        yield (
            msgspec.structs.replace(opts, kv_block_dir=d),
            msgspec.structs.replace(config, disagg=msgspec.structs.replace(config.disagg, block_dir=d)),
        )
    finally:
        shutil.rmtree(d, ignore_errors=True)


NOT_PASSED_ON = frozenset({"--role", "--instance-id", "--metrics-port"})
"""Worker flags `up --disagg` keeps for its own worker: the prefill worker gets its own identity
and a metrics port of its own."""


def worker_argv(args: argparse.Namespace, role: str) -> list[str]:
    """The `jetllm worker` flags that repeat `args` for another worker of `role`: every worker
    option set to something other than its default, except those `role` does not take."""
    from ..workers.roles import ROLES
    from ..workers.roles.flags import misplaced
    from .worker_flags import add_worker_options

    ref = argparse.ArgumentParser(add_help=False)
    add_worker_options(ref)
    out: list[str] = []
    for action in ref._actions:
        if not action.option_strings:
            continue
        flag = action.option_strings[0]
        value = getattr(args, action.dest, action.default)
        if value == action.default or flag in NOT_PASSED_ON or misplaced(role, [flag], ROLES):
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(action, argparse._StoreTrueAction):
            out.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value:
                out += [flag, str(item)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return ["--role", role, *out]


@contextlib.contextmanager
def prefill_worker(url: str, args: argparse.Namespace, env: dict[str, str]) -> Iterator[None]:
    """`jetllm worker --role prefill` beside this process's decode worker, stopped with it; `env`
    adds to ours (the cores its engine may use)."""
    import os
    import subprocess

    cmd = jetllm_command("worker", url, *worker_argv(args, "prefill"))
    shown = [redact(url) if part == url else part for part in cmd[3:]]
    print(f"jetllm up: prefill worker: jetllm {' '.join(shown)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, **env})
    try:
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(args.grace_period + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
