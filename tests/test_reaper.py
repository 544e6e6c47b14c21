"""The watchdog a worker leaves behind: when the worker ends, however it ends, the processes it
was told to watch end too and the directories it was told to remove go (an engine's KV-event
sockets). Real processes, no engine: a child stands in for the worker, a `sleep` for its engine."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

CHILD = textwrap.dedent(
    """
    import subprocess, sys, time
    from jetllm import reaper

    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    reaper.watch_pid(engine.pid)
    reaper.remove_at_exit(sys.argv[1])
    print(engine.pid, flush=True)
    if sys.argv[2] == "wait":
        time.sleep(600)
    """
)


def _start(tmp_path: Path, how: str) -> tuple[subprocess.Popen[str], int, Path]:
    sockets = tmp_path / "jetllm-kv-test"
    sockets.mkdir()
    (sockets / "inproc").write_bytes(b"")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(sockets), how],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert child.stdout is not None
    engine = int(child.stdout.readline())
    return child, engine, sockets


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone(engine: int, sockets: Path, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not sockets.exists() and not _alive(engine):
            return True
        time.sleep(0.05)
    return False


def test_a_killed_worker_leaves_neither_its_engine_nor_its_socket_directory(tmp_path):
    child, engine, sockets = _start(tmp_path, "wait")
    assert sockets.exists() and _alive(engine)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert _gone(engine, sockets), f"engine alive: {_alive(engine)}, sockets: {sockets.exists()}"


def test_a_worker_that_exits_on_its_own_leaves_nothing_either(tmp_path):
    child, engine, sockets = _start(tmp_path, "exit")
    child.wait()
    assert child.returncode == 0
    assert _gone(engine, sockets), f"engine alive: {_alive(engine)}, sockets: {sockets.exists()}"


def test_the_engines_of_a_process_put_their_sockets_in_a_directory_of_its_own(monkeypatch):
    """vLLM's socket files go where `VLLM_RPC_BASE_PATH` says: a process's own directory, which the
    watchdog removes, unless the operator chose one; a jetllm parent's is not the child's."""
    from jetllm.workers.engine import args

    tmp_path = Path(tempfile.mkdtemp(prefix="r"))  # short: socket paths end at ~107 bytes
    removed: list[str] = []
    monkeypatch.setattr(args.reaper, "remove_at_exit", removed.append)
    monkeypatch.setattr(args, "_made", [])
    monkeypatch.setattr(args.tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(args.RPC_BASE, raising=False)

    try:
        args.private_rpc_dir()
        own = os.environ[args.RPC_BASE]
        assert Path(own).parent == tmp_path and Path(own).name.startswith("jetllm-rpc-") and removed == [own]
        args.private_rpc_dir()  # a second engine in the same process: the same directory
        assert os.environ[args.RPC_BASE] == own and removed == [own]

        monkeypatch.setattr(args, "_made", [])  # as in a child that inherited its parent's setting
        args.private_rpc_dir()
        child = os.environ[args.RPC_BASE]
        assert child != own and removed == [own, child]

        monkeypatch.setenv(args.RPC_BASE, str(tmp_path / "sockets"))  # the operator's choice
        args.private_rpc_dir()
        assert os.environ[args.RPC_BASE] == str(tmp_path / "sockets") and removed == [own, child]
    finally:
        shutil.rmtree(tmp_path)
