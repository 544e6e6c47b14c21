"""A watchdog process that ends our child processes when we die, however we die.

vLLM spawns its engine core (`VLLM::EngineCore`, which forks `VLLM::Worker`s); `jetllm up`
starts a nats-server. When the process that started them is SIGKILLed (the OOM killer,
`kill -9`), nothing tells them: the engine keeps its memory (about 1 GB each on CPU, the KV
cache on a GPU) and the server its port, so a restarted worker finds the box full. A signal on
parent death (`PR_SET_PDEATHSIG`) would need code in vLLM's spawned processes; instead one small
process per worker holds the read end of a pipe from it: the kernel closes the write end when
the worker dies, and the watchdog then terminates what it was told to watch and removes the
directories it was told to remove (where an engine's processes put their sockets: a killed
engine leaves them).

Run as `python -m jetllm.reaper` by `watch()`; it imports nothing but the standard library and
psutil (a dependency of vLLM), and it never outlives the pipe.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from typing import IO, Any

log = logging.getLogger(__name__)

GRACE = 5.0
"""Seconds between SIGTERM (vLLM's engine shuts its own children down) and SIGKILL."""

_watchdog: subprocess.Popen[bytes] | None = None


def descendants() -> set[Any]:
    """This process's children and theirs (psutil processes; empty without psutil).

    Python's multiprocessing resource tracker is left out: it exits by itself once the last
    process using it is gone, and cleans up the shared memory they leaked, which it cannot do
    if it is killed first.
    """
    try:
        import psutil
    except ImportError:
        return set()
    found = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if not any("resource_tracker" in part for part in proc.cmdline()):
                found.add(proc)
        except psutil.Error:
            pass
    return found


def watch_pid(pid: int) -> None:
    """End process `pid` (a child started with subprocess) when this process dies."""
    try:
        import psutil
    except ImportError:
        return
    try:
        watch([psutil.Process(pid)])
    except psutil.NoSuchProcess:
        pass


def watch(procs: set[Any] | list[Any]) -> None:
    """End `procs` (psutil processes) when this process dies."""
    lines = []
    for p in procs:
        try:
            lines.append(f"{p.pid} {p.create_time()!r}")
        except Exception:  # gone already: nothing to end
            pass
    if lines:
        _tell(lines)


def remove_at_exit(path: str) -> None:
    """Remove directory `path` (one this process made) once this process has ended and what it
    watches is gone, however it ended."""
    _tell([f"rm {os.path.abspath(path)}"])


def _tell(lines: list[str]) -> None:
    global _watchdog
    try:
        if _watchdog is None:
            _watchdog = subprocess.Popen(
                [sys.executable, "-m", __name__, str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C to our group must not end it first
            )
        pipe: IO[bytes] = _watchdog.stdin  # type: ignore[assignment]
        pipe.write(b"".join(f"{line}\n".encode() for line in lines))
        pipe.flush()
    except Exception as exc:  # a safety net: never fail a start-up over it
        log.warning("child processes or temporary files will outlive this one if it is killed: %s", exc)


def _main(parent: int) -> int:
    import psutil

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watched: list[tuple[int, float]] = []
    paths: list[str] = []
    for line in sys.stdin.buffer:  # until the parent's end closes: it exited or was killed
        if line.startswith(b"rm "):
            paths.append(os.fsdecode(line[3:].rstrip(b"\n")))
            continue
        pid, started = line.split()
        watched.append((int(pid), float(started)))
    alive = []
    for pid, started in watched:
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started:  # not a new process that reused the pid
                proc.terminate()
                alive.append(proc)
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(alive, timeout=GRACE)
    names = []
    for proc in left:
        try:
            names.append(f"{proc.pid} ({proc.name()})")
            proc.kill()
        except psutil.Error:
            pass
    if names:
        print(
            f"jetllm reaper: killed {', '.join(names)}, left by {parent}, after {GRACE:.0f} s",
            file=sys.stderr,
        )
    for path in paths:  # after the processes that used them are gone
        shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(int(sys.argv[1])))
