"""Command lines for jetllm's own subcommands run as child processes (`jetllm up`, `demo`, the
benchmarks): this interpreter's jetllm, so the copy in the caller's virtual environment is the
one that runs, with the NATS server it is given."""

from __future__ import annotations

import sys


def jetllm_command(subcommand: str, url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "jetllm", subcommand, "--nats", url, *args]
