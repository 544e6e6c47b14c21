"""`jetllm bench-cluster`: what a three-node JetStream cluster keeps when its servers die under load.

For each configuration a fresh cluster on this host (R3 streams), a few workers and one producer
that keeps `--concurrency` jobs in flight. Once a third of the jobs are accepted, the jobs
stream's leader (or a majority: it and one more server) is SIGKILLed and started again after
`--outage` seconds. Every job is then followed to its result in the request log, and counted:
accepted (the producer got a PubAck), refused (it did not, within `publish_timeout`: the producer
knows), completed, failed (an error result), lost (accepted, no result by `--result-timeout`),
run twice (runs to completion the workers counted beyond the completed jobs; a lost job that had
run would count here too).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import anyio
import msgspec

from ..aio import run, task_group
from ..cpus import engine_cores
from ..natsserver import NatsCluster
from ..producer import Client
from ..producer.fleet import wait_for_workers, worker_statuses
from ..schemas import GenerateRequest, SamplingOptions, StopConditions, TokensPrompt
from ..spawn import jetllm_command, stop
from .run import choices, command_line, publish

MARKS = ("<!-- cluster:begin -->", "<!-- cluster:end -->")
KILLS = {"leader": "the jobs stream's leader", "majority": "a majority: the leader + 1"}
FAKE_WORKER = Path(__file__).resolve().parents[2] / "tests" / "helpers" / "fake_worker.py"


class Outcome(msgspec.Struct, kw_only=True):
    """One job as its producer saw it; times are seconds since the run started."""

    accepted: bool
    ended_at: float | None = None
    """When its result was read from the log; None: no result by the deadline."""
    error: str | None = None
    """The error code of an error result."""


class Row(msgspec.Struct, kw_only=True):
    sync_always: bool
    killed: str
    """A key of KILLS."""
    jobs: int
    accepted: int
    refused: int
    completed: int
    failed: int
    lost: int
    run_twice: int
    longest_pause_s: float
    """The longest time without a job ending, between the first and the last one to end."""
    seconds: float


def tally(outcomes: list[Outcome], runs: int, *, sync_always: bool, killed: str, seconds: float) -> Row:
    """The row of one configuration: `runs` is how many jobs the workers ran to completion."""
    accepted = [o for o in outcomes if o.accepted]
    ended = sorted(o.ended_at for o in accepted if o.ended_at is not None)
    completed = sum(1 for o in accepted if o.ended_at is not None and o.error is None)
    return Row(
        sync_always=sync_always,
        killed=killed,
        jobs=len(outcomes),
        accepted=len(accepted),
        refused=len(outcomes) - len(accepted),
        completed=completed,
        failed=sum(1 for o in accepted if o.ended_at is not None and o.error is not None),
        lost=sum(1 for o in accepted if o.ended_at is None),
        run_twice=max(0, runs - completed),
        longest_pause_s=max((b - a for a, b in zip(ended, ended[1:], strict=False)), default=0.0),
        seconds=seconds,
    )


class Workers:
    """Worker processes of one namespace, storing everything with 3 replicas."""

    def __init__(self, args: argparse.Namespace, url: str, namespace: str, log_dir: Path) -> None:
        if args.engine == "fake":
            if not FAKE_WORKER.is_file():
                raise SystemExit(
                    "--engine fake runs the light test engine of a source checkout "
                    f"(tests/helpers/fake_worker.py), which {FAKE_WORKER.parents[2]} lacks; "
                    "use --engine vllm, or run from a checkout"
                )
            cmd = [sys.executable, "-m", "tests.helpers.fake_worker", url, namespace, "--replicas", "3"]
            cmd += ["--slots", str(args.slots), "--step-delay", str(args.step_delay)]
            cwd: Path | None = FAKE_WORKER.parents[2]
        else:
            cmd = jetllm_command("worker", url, "--namespace", namespace)
            cmd += ["--replicas", "3", "--slots", str(args.slots), "--max-model-len", "512"]
            cmd += ["--kv-cache-bytes", str(256 << 20)]
            if args.model:
                cmd += ["--model", args.model]
            cwd = None
        self.procs = []
        for i in range(args.workers):
            log = open(log_dir / f"worker-{i}.log", "wb")
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **engine_cores(i, args.workers)}
            self.procs.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
                )
            )
            log.close()

    def stop(self) -> None:
        stop(*self.procs, group=True)


async def _jobs(
    client: Client, args: argparse.Namespace, started: float, accepted: anyio.Event
) -> list[Outcome]:
    """Detached jobs, `concurrency` at a time, each followed until its result is in the log."""
    outcomes: list[Outcome] = []
    limiter = anyio.Semaphore(args.concurrency)
    kill_at = max(1, args.jobs // 3)

    async def one(i: int) -> None:
        async with limiter:
            req = GenerateRequest(
                request_id=f"cluster-{uuid.uuid4().hex}",
                model=args.served_model_name,
                prompt=TokensPrompt([4 + i % 50, 5, 6]),
                sampling=SamplingOptions(temperature=0),
                stop=StopConditions(max_tokens=args.output_len, ignore_eos=True),
            )
            try:
                await client.submit(req)
            except Exception:  # not stored within publish_timeout, and the producer was told so
                outcomes.append(Outcome(accepted=False))
                return
            out = Outcome(accepted=True)
            outcomes.append(out)
            if sum(o.accepted for o in outcomes) >= kill_at:
                accepted.set()
            with anyio.move_on_after(args.result_timeout):
                while True:
                    try:
                        result = await client.result(req.request_id)
                    except Exception:  # the log is unreachable for now
                        result = None
                    if result is not None:
                        out.ended_at = time.monotonic() - started
                        out.error = result.error.code.value if result.error else None
                        return
                    await anyio.sleep(0.25)

    async with task_group() as tg:
        for i in range(args.jobs):
            tg.start_soon(one, i)
    return outcomes


async def _kill(cluster: NatsCluster, client: Client, how: str, outage: float) -> list[str]:
    """SIGKILL the jobs stream's leader (and, for a majority, the next member too); start them again
    after `outage` seconds."""
    info = await client.js.stream_info(client.names.jobs_stream)
    if info.cluster is None or not info.cluster.leader:
        raise RuntimeError(f"the jobs stream has no leader to kill: {info.cluster}")
    leader = info.cluster.leader
    members = list(cluster.servers)
    victims = [leader] if how == "leader" else [leader, members[(members.index(leader) + 1) % len(members)]]
    for member in victims:
        cluster.kill(member)
    await anyio.sleep(outage)
    for member in victims:
        await anyio.to_thread.run_sync(cluster.start_member, member)
    return victims


async def _runs(client: Client, workers: int) -> int:
    """Jobs the workers ran to completion, once none runs anything any more."""
    with anyio.fail_after(120):
        while True:
            statuses = await worker_statuses(client.nc, client.names, timeout=1.0)
            if len(statuses) >= workers and not any(s.in_flight for s in statuses):
                return sum(int(s.extra["completed"]) for s in statuses)
            await anyio.sleep(0.5)


async def _row(args: argparse.Namespace, sync_always: bool, how: str, log_dir: Path) -> Row:
    namespace = f"cluster-{uuid.uuid4().hex[:6]}"
    with NatsCluster(log_dir / "nats", sync_always=sync_always) as cluster:
        workers = Workers(args, cluster.url, namespace, log_dir)
        try:
            async with Client(cluster.url, namespace=namespace) as client:
                await wait_for_workers(
                    client.nc, client.names, model=args.served_model_name, count=args.workers, timeout=600
                )
                print(
                    f"bench-cluster: {args.jobs} jobs, sync_always={sync_always}, killing the {how} ...",
                    file=sys.stderr,
                    flush=True,
                )
                started = time.monotonic()
                enough = anyio.Event()
                async with task_group() as tg:

                    async def killer() -> None:
                        await enough.wait()
                        victims = await _kill(cluster, client, how, args.outage)
                        print(f"  killed {', '.join(victims)}; started again", file=sys.stderr, flush=True)

                    tg.start_soon(killer)
                    outcomes = await _jobs(client, args, started, enough)
                seconds = time.monotonic() - started
                runs = await _runs(client, args.workers)
        finally:
            workers.stop()
    return tally(outcomes, runs, sync_always=sync_always, killed=how, seconds=seconds)


async def _main(args: argparse.Namespace, log_dir: Path) -> list[Row]:
    rows = []
    for sync_always in (False, True):
        for how in args.kill:
            rows.append(await _row(args, sync_always, how, log_dir / f"{how}-{int(sync_always)}"))
    return rows


def report(rows: list[Row], args: argparse.Namespace, command: str) -> str:
    engine = "the light test engine" if args.engine == "fake" else "vLLM"
    head = (
        f"Workload: {args.jobs} detached greedy jobs of {args.output_len} tokens, {args.concurrency} in "
        f"flight, {args.workers} workers ({engine}, {args.slots} slots each), a 3-node cluster on one "
        f"host with every stream R3; once a third of the jobs are accepted, the servers named are "
        f"SIGKILLed and started again {args.outage:.0f} s later.\n\n"
        f"Command: `{command}`\n\n"
        "| servers fsync every write | killed | accepted | refused | completed | failed | lost | "
        "run twice | longest pause | seconds |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    body = "".join(
        f"| {'yes' if r.sync_always else 'no'} | {KILLS[r.killed]} | {r.accepted} | {r.refused} | "
        f"{r.completed} | {r.failed} | {r.lost} | {r.run_twice} | {r.longest_pause_s:.1f} s | "
        f"{r.seconds:.1f} |\n"
        for r in rows
    )
    return head + body


def cmd_cluster(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.served_model_name is None:
        args.served_model_name = "fake" if args.engine == "fake" else args.model or "tiny"
    log_dir = Path(tempfile.mkdtemp(prefix="jetllm-bench-cluster-"))
    rows = run(_main, args, log_dir)
    text = report(rows, args, command_line("bench-cluster"))
    publish(text, log_dir, write=args.write, marks=MARKS)
    return 1 if any(r.lost or r.run_twice for r in rows if r.killed == "leader") else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-cluster",
        help="jobs accepted, completed, lost and run twice when cluster servers die under load",
        description="Start a 3-node JetStream cluster on this host with workers and a producer; "
        "SIGKILL the jobs stream's leader (or a majority of the servers) mid-load and start them "
        "again; with and without fsync on every write. Report per configuration how many jobs were "
        "accepted, completed, lost and run twice.",
    )
    p.add_argument("--jobs", type=int, default=300, help="jobs per configuration")
    p.add_argument("--concurrency", type=int, default=48, help="jobs in flight at once")
    p.add_argument("--output-len", type=int, default=40, help="tokens per job (greedy)")
    p.add_argument("--workers", type=int, default=2, help="worker processes")
    p.add_argument("--slots", type=int, default=32, help="slots per worker")
    p.add_argument(
        "--kill",
        type=choices("--kill", tuple(KILLS)),
        default=list(KILLS),
        help="comma separated: leader (the jobs stream's), majority (it and one more server)",
    )
    p.add_argument("--outage", type=float, default=10.0, help="seconds before the killed servers start again")
    p.add_argument(
        "--result-timeout",
        type=float,
        default=120.0,
        help="seconds an accepted job may take to have its result before it counts as lost",
    )
    p.add_argument(
        "--engine",
        choices=("fake", "vllm"),
        default="fake",
        help="fake: the light test engine of a source checkout (the broker is what is measured); "
        "vllm: real `jetllm worker` processes",
    )
    p.add_argument("--step-delay", type=float, default=0.02, help="fake engine: seconds per token")
    p.add_argument("--model", default=None, help="vllm: model (default: the tiny model)")
    p.add_argument("--served-model-name", default=None, help="name of the model on the wire")
    p.add_argument("--write", default=None, help="replace the cluster section of this markdown file")
    p.set_defaults(func=cmd_cluster)
