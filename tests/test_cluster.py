"""jetllm on a three-node JetStream cluster: every stream and bucket has three copies, and losing
or restarting servers under load loses no accepted job and ends no request twice.

Workers run the light engine in real processes (the engine does not matter here; the broker
does). Its tokens depend only on the context, so every request's output is known in advance.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import pytest
from nats.js.api import StreamConfig

from jetllm import tinymodel
from jetllm.bench.cluster import Outcome, tally
from jetllm.errors import ReplicasUnavailable
from jetllm.natsserver import NatsCluster
from jetllm.producer import Client
from jetllm.producer.fleet import wait_for_workers, worker_statuses
from jetllm.producer.lora import LoraAdmin
from jetllm.producer.registry import watch
from jetllm.schemas import AcceptedFrame, EmbedsPrompt, FinalFrame, Frame, GenerateRequest, TokensFrame
from jetllm.subjects.connection import connect
from jetllm.subjects.names import Names
from jetllm.subjects.policy import QueuePolicy
from jetllm.subjects.setup import ensure_streams
from jetllm.workers.requestlog import RequestLog

from .helpers.cluster import stream_leader
from .jobs import req
from .test_migration import expected_tokens

pytestmark = pytest.mark.anyio


class Load:
    """Requests streamed by one producer, `concurrency` at a time; what each of them received."""

    def __init__(self, client: Client, *, max_tokens: int, concurrency: int) -> None:
        self.client = client
        self.max_tokens = max_tokens
        self.requests: list[GenerateRequest] = []
        self.frames: dict[str, list[Frame]] = {}
        self.failed: dict[str, str] = {}
        self.done = 0
        self._limiter = anyio.Semaphore(concurrency)

    async def run(self, count: int) -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(count):
                tg.start_soon(self._one, self._new())

    async def run_until(self, stop: anyio.Event) -> None:
        """New requests as fast as they end, until `stop`; then the last ones finish."""
        async with anyio.create_task_group() as tg:
            while not stop.is_set():
                await self._limiter.acquire()
                self._limiter.release()
                tg.start_soon(self._one, self._new())
                await anyio.sleep(0)

    def _new(self) -> GenerateRequest:
        r = req("fake", [1 + len(self.requests) % 50, 2, 3], max_tokens=self.max_tokens)
        self.requests.append(r)
        self.frames[r.request_id] = []
        return r

    async def _one(self, r) -> None:
        async with self._limiter:
            try:
                async for frame in self.client.generate(r):
                    self.frames[r.request_id].append(frame)
            except Exception as exc:
                self.failed[r.request_id] = f"{type(exc).__name__}: {exc}"
            self.done += 1

    def streaming(self) -> int:
        """Requests that have tokens and no end yet."""
        return sum(
            1
            for fs in self.frames.values()
            if any(isinstance(f, TokensFrame) for f in fs) and not isinstance(fs[-1], FinalFrame)
        )

    async def until_streaming(self, count: int, timeout: float = 30.0) -> None:
        with anyio.fail_after(timeout):
            while self.streaming() < count:
                await anyio.sleep(0.02)

    def problems(self) -> list[str]:
        """What any request got wrong: an error, a token too many or too few, a gap or duplicate
        in its frames, no final frame or more than one."""
        out = [f"{rid}: {err}" for rid, err in self.failed.items()]
        for r in self.requests:
            if r.request_id in self.failed:
                continue
            frames = [f for f in self.frames[r.request_id] if not isinstance(f, AcceptedFrame)]
            tokens = [t for f in frames if isinstance(f, TokensFrame) for t in f.token_ids]
            finals = [f for f in frames if isinstance(f, FinalFrame)]
            want = expected_tokens(list(r.prompt.token_ids), r.stop.max_tokens)
            if tokens != want:
                out.append(f"{r.request_id}: {len(tokens)} tokens, {tokens == want[: len(tokens)]=}")
            if [f.seq for f in frames] != list(range(1, len(frames) + 1)):
                out.append(f"{r.request_id}: frame seqs {[f.seq for f in frames]}")
            if len(finals) != 1 or frames[-1] is not finals[0]:
                out.append(f"{r.request_id}: {len(finals)} final frames")
        return out


async def completions(c: Client, workers: int) -> int:
    """Requests the workers ran to completion, summed over all of them, once none runs anything
    (a worker counts a request once JetStream confirmed its ack, which a failover can delay)."""
    with anyio.fail_after(60):
        while True:
            statuses = await worker_statuses(c.nc, c.names, timeout=1.0)
            if len(statuses) == workers and not any(s.in_flight for s in statuses):
                return sum(int(s.extra["completed"]) for s in statuses)
            await anyio.sleep(0.2)


async def start_workers(start_cluster_worker, url: str, namespace: str, count: int, *args: str):
    workers = [start_cluster_worker(namespace, *args) for _ in range(count)]
    for w in workers:
        await w.wait_ready(url, timeout=60)
    return workers


async def use_everything(c: Client, tmp_path: Path) -> None:
    """What producers and commands do that creates buckets: offload prompt embeddings, push and
    list LoRA adapters, watch the registry (a Client makes the streams as it connects)."""
    embeds = EmbedsPrompt(dtype="float32", shape=[2, 4], data=bytes(32))
    await c.offload_embeds(msgspec.structs.replace(req("fake"), prompt=embeds))
    admin = LoraAdmin(c.nc, c.names)
    await admin.push(tinymodel.build_lora(tmp_path / "adapter"), "a")
    await admin.desired("fake")
    async for _ in watch(c.js, c.names):
        break


async def copies(c: Client) -> dict[str, tuple[int, int]]:
    """Per stream of the namespace (KV buckets and object stores are streams too): the replicas
    configured, and how many servers hold a copy."""
    found = {}
    for info in await c.js.streams_info():
        if c.names.namespace.upper() in info.config.name:
            found[info.config.name] = (info.config.num_replicas, 1 + len(info.cluster.replicas or []))
    return found


async def test_every_stream_bucket_and_consumer_has_three_copies(
    nats_cluster: NatsCluster, start_cluster_worker, namespace, tmp_path
):
    """Only the worker is told --replicas 3. A producer and the LoRA commands that come first make
    everything but the registry with one copy (a new namespace); the worker brings all of it to three; producers
    that come after it make nothing with fewer, and scale nothing down."""
    url, names = nats_cluster.url, Names(namespace)
    every = {
        names.jobs_stream,
        names.dlq_stream,
        names.requests_stream,
        names.cancels_stream,
        names.traces_stream,
        names.kv_events_stream,
        f"KV_{names.registry_bucket}",
        f"KV_{names.lora_bucket}",
        f"OBJ_{names.adapters_store}",
        f"OBJ_{names.embeds_store}",
    }
    made_by_workers = {f"KV_{names.registry_bucket}"}  # its readers open it, never make it
    async with Client(url, namespace=namespace, embeds_inline_max=16) as c:
        await use_everything(c, tmp_path / "first")
        assert await copies(c) == {name: (1, 1) for name in every - made_by_workers}
        await start_workers(start_cluster_worker, url, namespace, 1)
        assert await copies(c) == {name: (3, 3) for name in every}
    async with Client(url, namespace=namespace, embeds_inline_max=16) as later:
        await later.js.delete_object_store(names.embeds_store)  # made again by the next offload
        await use_everything(later, tmp_path / "later")
        done = [f async for f in later.generate(req("fake", [4, 5], max_tokens=5))]
        assert done[-1].usage.completion_tokens == 5
        assert await copies(later) == {name: (3, 3) for name in every}
        consumer = await later.js.consumer_info(names.jobs_stream, names.consumer("generate", "fake"))
    assert 1 + len(consumer.cluster.replicas or []) == 3


async def test_killing_the_jobs_stream_leader_mid_load_loses_nothing(
    nats_cluster: NatsCluster, start_cluster_worker, namespace
):
    """SIGKILL of the server leading the jobs stream while requests stream, wait in the queue and
    are still being submitted: the queued jobs survive on the other two, publishes during the
    election are retried, the running requests go on, each request gets exactly its tokens in
    order and one final frame, and each ran to completion once."""
    url = nats_cluster.url
    await start_workers(start_cluster_worker, url, namespace, 3, "--slots", "12", "--step-delay", "0.02")
    async with Client(url, namespace=namespace) as c:
        load = Load(c, max_tokens=80, concurrency=40)
        async with anyio.create_task_group() as tg:
            tg.start_soon(load.run, 90)
            await load.until_streaming(20)
            victim = await stream_leader(c.js, c.names.jobs_stream)
            nats_cluster.kill(victim)
        assert load.problems() == []
        await anyio.to_thread.run_sync(nats_cluster.wait_healthy)
        assert await stream_leader(c.js, c.names.jobs_stream) != victim
        assert await completions(c, 3) == 90


def batch_lines(count: int, max_tokens: int) -> list[dict]:
    return [
        {"id": f"l{i}", "token_ids": [3 + i, 9], "max_tokens": max_tokens, "stop": {"ignore_eos": True}}
        for i in range(count)
    ]


def start_batch(url: str, namespace: str, src: Path, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jetllm", "batch", "--nats", url, "--namespace", namespace]
    cmd += ["--model", "fake", str(src), "-o", str(out), "--concurrency", "24", "--quiet"]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parent.parent
    )


async def test_killing_the_request_log_leader_mid_batch_loses_nothing(
    nats_cluster: NatsCluster, start_cluster_worker, namespace, tmp_path
):
    """`jetllm batch` against all three servers; SIGKILL of the request log's leader once some lines
    are done and others run: the batch ends with exactly one right result per line."""
    url = nats_cluster.url
    await start_workers(start_cluster_worker, url, namespace, 2, "--slots", "12", "--step-delay", "0.02")
    lines = batch_lines(48, 60)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    batch = start_batch(url, namespace, src, out)
    try:
        async with Client(url, namespace=namespace) as c:
            with anyio.fail_after(60):
                while True:
                    statuses = await worker_statuses(c.nc, c.names)
                    done = sum(int(s.extra["completed"]) for s in statuses)
                    if done >= 6 and sum(s.in_flight for s in statuses) >= 12:
                        break
                    await anyio.sleep(0.05)
            victim = await stream_leader(c.js, c.names.requests_stream)
            nats_cluster.kill(victim)
            _, err = await anyio.to_thread.run_sync(lambda: batch.communicate(timeout=120))
            assert batch.returncode == 0, err.decode()[-2000:]
            results = [json.loads(x) for x in out.read_text().splitlines()]
            assert [r["id"] for r in results] == [x["id"] for x in lines]
            assert [r["token_ids"] for r in results] == [expected_tokens(x["token_ids"], 60) for x in lines]
            await anyio.to_thread.run_sync(nats_cluster.wait_healthy)
            assert await stream_leader(c.js, c.names.requests_stream) != victim
            assert await completions(c, 2) == 48
    finally:
        if batch.poll() is None:
            batch.kill()
            batch.wait()


async def test_records_dropped_while_the_request_log_had_no_leader_are_written_again(
    nats_cluster: NatsCluster, start_cluster_worker, namespace
):
    """The request log's leader dies under a long request, on a server neither its worker nor its
    producer is connected to: nothing reconnects, yet the checkpoints published during the
    election were dropped. The worker writes them again once the log has a new leader, so the
    log holds every frame sent (what a producer that lost frames in the failover reads back),
    and the request ends with exactly its output."""
    async with Client(nats_cluster.url, namespace=namespace, policy=QueuePolicy(replicas=3)) as setup:
        victim = await stream_leader(setup.js, setup.names.requests_stream)
    worker_url, producer_url = [s.url for m, s in nats_cluster.servers.items() if m != victim]
    w = start_cluster_worker(namespace, "--step-delay", "0.05", url=worker_url)
    await w.wait_ready(worker_url, timeout=60)
    r = req("fake", [7, 1], max_tokens=400)
    async with Client(producer_url, namespace=namespace) as c:
        frames: list[Frame] = []

        async def stream() -> None:
            async for frame in c.generate(r):
                frames.append(frame)

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream)
            with anyio.fail_after(30):
                while sum(isinstance(f, TokensFrame) for f in frames) < 20:
                    await anyio.sleep(0.05)
            nats_cluster.kill(victim)
            await anyio.to_thread.run_sync(nats_cluster.wait_healthy)
            await anyio.sleep(1.0)  # a checkpoint under the new leader
            assert not isinstance(frames[-1], FinalFrame), "the request ended before the check"
            sent = max(f.seq for f in frames if isinstance(f, TokensFrame))
            log = RequestLog(c.nc, c.names)
            missing = list(range(1, sent + 1))
            with anyio.move_on_after(10):
                while missing:
                    logged = {f.seq for f in (await log.history(r.request_id)).frames}
                    missing = [seq for seq in range(1, sent + 1) if seq not in logged]
                    await anyio.sleep(0.2)
            assert not missing, f"the request log lacks frames {missing} the producer was sent"
    tokens = [t for f in frames if isinstance(f, TokensFrame) for t in f.token_ids]
    assert tokens == expected_tokens([7, 1], 400)
    assert isinstance(frames[-1], FinalFrame)


async def test_a_rolling_restart_of_all_three_servers_under_load_loses_nothing(
    nats_cluster: NatsCluster, start_cluster_worker, namespace
):
    """Each server in turn is stopped (SIGTERM) and started again, the next one only once the
    cluster is healthy, while requests keep coming: every request gets exactly its output."""
    url = nats_cluster.url
    await start_workers(start_cluster_worker, url, namespace, 2, "--slots", "16", "--step-delay", "0.02")
    async with Client(url, namespace=namespace) as c:
        load = Load(c, max_tokens=60, concurrency=16)
        restarted = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(load.run_until, restarted)
            await load.until_streaming(8)
            for member in nats_cluster.servers:
                await anyio.to_thread.run_sync(nats_cluster.restart, member)
            restarted.set()
        assert load.problems() == []
        assert await completions(c, 2) == len(load.requests)


async def test_a_worker_on_one_server_serves_a_producer_on_another(
    nats_cluster: NatsCluster, start_cluster_worker, namespace
):
    n1, n2 = nats_cluster["n1"].url, nats_cluster["n2"].url
    w = start_cluster_worker(namespace, url=n1)
    await w.wait_ready(n1, timeout=60)
    async with Client(n2, namespace=namespace) as c:
        assert c.nc.connected_url.port == nats_cluster["n2"].port
        await wait_for_workers(c.nc, c.names, model="fake", timeout=30)
        load = Load(c, max_tokens=40, concurrency=20)
        await load.run(20)
        assert load.problems() == []


async def test_the_shipped_cluster_configs_form_a_jetstream_cluster(tmp_path):
    """infra/nats/cluster/n1.conf to n3.conf on loopback: what differs per host (addresses, ports,
    routes, the store directory) comes from the command line; every other setting is as shipped."""
    infra = Path(__file__).resolve().parent.parent / "infra" / "nats" / "cluster"
    configs = []
    for member in ("n1", "n2", "n3"):
        text = (infra / f"{member}.conf").read_text()
        assert f"server_name: {member}" in text
        configs.append(tmp_path / f"{member}.conf")
        configs[-1].write_text(
            "\n".join(line for line in text.splitlines() if not line.strip().startswith("store_dir"))
        )
    with NatsCluster(tmp_path / "cluster", configs=configs) as cluster:
        nc = await connect(cluster.url)
        try:
            assert nc.max_payload == 8 * 1024 * 1024
            js = nc.jetstream()
            await js.add_stream(StreamConfig(name="R3", subjects=["r3.>"], num_replicas=3))
            await js.publish("r3.x", b"stored three times")
            info = await js.stream_info("R3")
            assert info.cluster.name == "jetllm"
            assert sorted([info.cluster.leader] + [p.name for p in info.cluster.replicas]) == [
                "n1",
                "n2",
                "n3",
            ]
        finally:
            await nc.close()


async def test_three_replicas_on_a_single_server_is_refused_naming_the_flag(nats_url, namespace):
    nc = await connect(nats_url)
    try:
        with pytest.raises(ReplicasUnavailable, match="replicas=3.*--replicas 1"):
            await ensure_streams(nc.jetstream(), Names(namespace), QueuePolicy(replicas=3))
    finally:
        await nc.close()


@pytest.mark.parametrize(
    ("outcomes", "runs", "expected"),
    [
        # every job accepted and ended once
        (
            [Outcome(accepted=True, ended_at=1.0), Outcome(accepted=True, ended_at=2.5)],
            2,
            (2, 0, 2, 0, 0, 0, 1.5),
        ),
        # a refused job is not lost: its producer was told
        ([Outcome(accepted=False), Outcome(accepted=True, ended_at=1.0)], 1, (1, 1, 1, 0, 0, 0, 0.0)),
        # accepted without a result: lost; a run beyond the completed jobs counts as a second run
        ([Outcome(accepted=True), Outcome(accepted=True, ended_at=3.0)], 2, (2, 0, 1, 0, 1, 1, 0.0)),
        # an error result ends a job without completing it
        ([Outcome(accepted=True, ended_at=1.0, error="engine_error")], 0, (1, 0, 0, 1, 0, 0, 0.0)),
    ],
)
def test_bench_cluster_counts_each_job_once(outcomes, runs, expected):
    row = tally(outcomes, runs, sync_always=False, killed="leader", seconds=1.0)
    got = (row.accepted, row.refused, row.completed, row.failed, row.lost, row.run_twice, row.longest_pause_s)
    assert got == expected
