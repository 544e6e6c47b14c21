"""jetllm's own subcommands run as child processes (`jetllm up`, `demo`, the benchmarks): their
command line (this interpreter's jetllm, so the copy in the caller's virtual environment is the
one that runs, with the NATS server it is given) and their stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def jetllm_command(subcommand: str, url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "jetllm", subcommand, "--nats", url, *args]


def stop(*procs: subprocess.Popen, grace: float = 60.0, group: bool = False) -> None:
    """SIGTERM to all at once (an engine's shutdown takes seconds, and several need not take them
    one after another), then each is waited for up to `grace` seconds and SIGKILLed if still up.
    `group`: the SIGKILL goes to each one's process group (children started with
    `start_new_session`), so the engine processes under a worker go with it."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()
