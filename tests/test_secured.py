"""jetllm against a nats-server configured by `accounts_config`: one user per identity, each allowed
only what its access role needs. The main paths work under the restricted identities (and the
server refuses nothing on them), and every refusal becomes one clear error, at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import nats.errors
import numpy as np
import pytest

from jetllm import embeds_prompt, tinymodel
from jetllm.batches.runner import BatchRunner
from jetllm.batches.service import BatchService
from jetllm.errors import ConnectRefused, NotPermitted, RequestFailed
from jetllm.natsserver import NatsServer
from jetllm.openai.endpoints import CHAT
from jetllm.producer import Client, deadletters
from jetllm.producer.fleet import ask, worker_statuses
from jetllm.producer.lora import LoraAdmin
from jetllm.producer.registry import instances
from jetllm.producer.traces import trace_records
from jetllm.schemas import (
    AcceptedFrame,
    ControlDone,
    ErrorCode,
    FinalFrame,
    GenerateRequest,
    LoadReport,
    SleepRequest,
    StopConditions,
    TokensFrame,
)
from jetllm.subjects import codec
from jetllm.subjects.connection import connect
from jetllm.subjects.denials import checked
from jetllm.subjects.names import Names
from jetllm.subjects.natsconfig import User, accounts_config
from jetllm.subjects.policy import QueuePolicy
from jetllm.subjects.setup import ensure_lora_bucket, ensure_registry, ensure_streams
from jetllm.workers import Worker, WorkerConfig
from jetllm.workers.lora import LoraSettings

from .conftest import FakeWorkerProcess, inproc_worker
from .fake_engine import FakeEngine
from .jobs import kv_batches, req
from .test_lora_plane import TINY_FACTS
from .test_migration import collect_until_kill, expected_tokens

pytestmark = pytest.mark.anyio

NAMESPACES = [f"sec{i}" for i in range(16)]
USERS = [
    User("producer", name="alice"),
    User("producer", name="bob"),
    User("router", name="router"),
    User("worker", name="worker"),
    User("admin", name="admin"),
]


@dataclass
class Secured:
    server: NatsServer
    passwords: dict[str, str]
    seed_file: Path
    """The nkey seed of a second worker identity."""

    def url(self, user: str | None = None, password: str | None = None) -> str:
        if user is None:
            return f"nats://127.0.0.1:{self.server.port}"
        return f"nats://{user}:{password or self.passwords[user]}@127.0.0.1:{self.server.port}"

    def log_offset(self) -> int:
        return self.server.log_file.stat().st_size

    def refusals_since(self, offset: int) -> list[str]:
        """The server's own record of what it refused:
        `"JETLLM/user:alice" - Publish Violation - Subject "..."`."""
        with open(self.server.log_file, "rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
        return [line.split(" - ", 3)[-1] for line in lines if "Violation" in line]


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Iterator[Secured]:
    import nkeys

    d = tmp_path_factory.mktemp("secured")
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    seed_file = d / "worker.nk"
    seed_file.write_bytes(seed + b"\n")
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    users = [*USERS, User("worker", nkey=public)]
    passwords = {u.name: f"pw-{u.name}-{uuid.uuid4().hex[:8]}" for u in USERS if u.name}
    env = {u.password_variable: passwords[u.name] for u in USERS if u.name}
    server = NatsServer(d / "nats", extra_config=accounts_config(NAMESPACES, users), env=env)
    with server:
        yield Secured(server, passwords, seed_file)


_unused = iter(NAMESPACES)


@pytest.fixture
def ns() -> str:
    """A namespace of its own, among those the server's permissions name."""
    return next(_unused)


def only_expected(refusals: list[str]) -> list[str]:
    """Refusals other than the one a producer or router meets on connecting, before it checks that
    the streams exist instead of creating them."""
    return [r for r in refusals if "$JS.API.STREAM.CREATE.JETLLM_" not in r or "user:worker" in r]


async def test_a_producer_generates_cancels_runs_a_batch_and_sends_embeddings_through_a_worker(
    secured, ns, tmp_path
):
    start = secured.log_offset()
    engine = FakeEngine(step_delay=0.01)
    engine.facts.hidden_size, engine.facts.prompt_embeds = 8, True
    async with inproc_worker(secured.url("worker"), engine, namespace=ns):
        async with Client(secured.url("alice"), namespace=ns, embeds_inline_max=0) as c:
            done = await c.complete(req("fake", [3, 1, 4], max_tokens=6))
            assert done.token_ids == expected_tokens([3, 1, 4], 6)
            r = req("fake", max_tokens=200)
            async for frame in c.generate(r):  # leaving early cancels it: the record and the notice
                if isinstance(frame, TokensFrame):
                    break
            with anyio.fail_after(10):
                while (result := await c.result(r.request_id)) is None:
                    await anyio.sleep(0.05)
            assert result.error is not None and result.error.code == ErrorCode.CANCELLED
            big = GenerateRequest(
                request_id=f"e-{uuid.uuid4().hex}",
                model="fake",
                prompt=embeds_prompt(np.ones((3, 8), np.float32)),  # through the object store
                stop=StopConditions(max_tokens=2),
            )
            assert len((await c.complete(big)).token_ids) == 2
        lines = tmp_path / "in.jsonl"
        lines.write_text("".join(f'{{"token_ids": [{i}, 2, 3], "max_tokens": 3}}\n' for i in range(5)))
        from jetllm.batch import run_batch

        summary = await run_batch(
            secured.url("bob"), ns, lines, tmp_path / "out.jsonl", model="fake", batch_id="b1"
        )
        assert (summary.lines, summary.errors) == (5, 0), summary
    assert only_expected(secured.refusals_since(start)) == []


async def test_a_gateway_and_its_batch_runner_run_a_batch_under_the_router_identity(secured, ns):
    """The files store, the batch states, the batch queue and its consumer, and the results of
    the lines: everything the OpenAI files and batches need, and nothing refused on the way."""
    start = secured.log_offset()
    async with inproc_worker(secured.url("worker"), FakeEngine(), namespace=ns):
        async with Client(secured.url("router"), namespace=ns) as c:
            service = await BatchService.open(c.js, c.names, ack_wait=2.0)
            lines = [
                {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": CHAT,
                    "body": {
                        "model": "fake",
                        "messages": [{"role": "user", "content": f"line {i}"}],
                        "max_tokens": 4,
                    },
                }
                for i in range(3)
            ]
            up = await service.upload(
                b"".join(json.dumps(x).encode() + b"\n" for x in lines), "in.jsonl", "batch"
            )
            batch = await service.create(up.id, CHAT)
            async with anyio.create_task_group() as tg:
                tg.start_soon(BatchRunner(c, service, ack_wait=2.0).serve)
                with anyio.fail_after(60):
                    while (batch := await service.get(batch.id)).status not in ("completed", "failed"):
                        await anyio.sleep(0.1)
                tg.cancel_scope.cancel()
            assert (batch.status, batch.request_counts.completed) == ("completed", 3), batch.errors
            assert batch.output_file_id is not None
            out = await service.content(batch.output_file_id)
            assert [json.loads(x)["custom_id"] for x in out.splitlines()] == ["r0", "r1", "r2"]
            assert [f.id for f in await service.list_files("batch_output")] == [batch.output_file_id]
            assert [b.id for b in (await service.list())[0]] == [batch.id]
            await service.delete_file(up.id)
    refusals = secured.refusals_since(start)
    assert only_expected(refusals) == [], refusals


async def first_tokens(c: Client, request_id: str) -> None:
    """Until the request's log holds tokens: it is claimed and running."""
    with anyio.fail_after(20):
        async for frame in c.attach(request_id):
            if isinstance(frame, TokensFrame):
                return


async def test_a_producer_cancels_queued_running_and_orphaned_requests_without_writing_the_log(
    secured, ns, tmp_path
):
    """A producer may not write the request log, yet each kind of cancel still holds: a job
    cancelled before any worker pulled it never runs, a running one stops, and one whose worker
    died is not resumed by the worker that gets it next. The server refuses nothing on the way."""
    start = secured.log_offset()
    policy = QueuePolicy(ack_wait=2.0)
    admin = await connect(secured.url("admin"))
    await ensure_streams(admin.jetstream(), Names(ns), policy)
    await admin.close()
    first = FakeWorkerProcess(
        secured.url("worker"), ns, tmp_path / "a.log", "--step-delay", "0.05", "--checkpoint-interval", "0.1",
        "--ack-wait", "2",
    )  # fmt: skip
    try:
        async with Client(secured.url("alice"), namespace=ns) as c:
            queued, running, orphan = (req("fake", max_tokens=5000) for _ in range(3))
            await c.submit(queued)
            await c.cancel(queued.request_id, reason="changed my mind")
            await first.wait_ready(secured.url("admin"), timeout=30)
            dropped = await c.wait_result(queued.request_id, timeout=20)
            assert dropped.error is not None and dropped.error.code == ErrorCode.CANCELLED
            assert "changed my mind" in dropped.error.message and dropped.token_ids in ([], [[]])

            await c.submit(running)
            await first_tokens(c, running.request_id)
            await c.cancel(running.request_id)
            stopped = await c.wait_result(running.request_id, timeout=20)
            assert stopped.error is not None and stopped.error.code == ErrorCode.CANCELLED
            assert stopped.attempt == 1

            await c.submit(orphan)
            await first_tokens(c, orphan.request_id)
            first.signal(signal.SIGKILL)
            assert first.wait(timeout=10) != 0
            await c.cancel(orphan.request_id, reason="its worker died")  # only the durable record is heard
            async with inproc_worker(secured.url("worker"), FakeEngine(), namespace=ns, policy=policy) as w:
                ended = await c.wait_result(orphan.request_id, timeout=30)
                assert ended.error is not None and ended.error.code == ErrorCode.CANCELLED
                assert "its worker died" in ended.error.message and ended.attempt == 2
                assert (w.counters.cancelled, w.counters.completed) == (1, 0)
    finally:
        first.stop()
    assert only_expected(secured.refusals_since(start)) == []


async def test_directed_jobs_are_placed_run_and_swept_under_restricted_identities(secured, ns):
    """A producer addresses a job to a worker (reading its registry record first); a job left for
    an instance that is gone is moved by a worker's sweep; the server refuses nothing on the way."""
    start = secured.log_offset()
    url = secured.url("worker")
    async with (
        inproc_worker(url, FakeEngine(), namespace=ns, instance="wa", registry_interval=0.3),
        inproc_worker(url, FakeEngine(), namespace=ns, instance="wb", registry_interval=0.3),
    ):
        async with Client(secured.url("alice"), namespace=ns) as c:
            for target in ("wa", "wb"):
                frames = [f async for f in c.generate(req("fake", max_tokens=2), instance=target)]
                assert [f.worker for f in frames if isinstance(f, AcceptedFrame)] == [target]
            stranded = req("fake", max_tokens=2)
            await c.js.publish(
                Names(ns).directed_jobs("generate", "fake", "gone"),
                codec.encode(stranded),
                headers={"Nats-Msg-Id": stranded.request_id},
            )
            result = await c.wait_result(stranded.request_id, timeout=15)
            assert result.error is None
    assert only_expected(secured.refusals_since(start)) == []


async def test_a_router_reads_the_fleet_and_only_admin_sleeps_and_wakes_it(secured, ns):
    start = secured.log_offset()
    async with inproc_worker(secured.url("worker"), FakeEngine(), namespace=ns, registry_interval=0.5) as w:
        router = await connect(secured.url("router"))
        admin = await connect(secured.url("admin"))
        names = Names(ns)
        try:
            js = router.jetstream()
            assert [r.instance for r in await instances(js, names)] == [w.instance]
            assert [s.instance for s in await worker_statuses(router, names)] == [w.instance]
            loads = await router.subscribe(names.load_all)
            report = codec.Decoder(LoadReport).decode((await loads.next_msg(timeout=5)).data)
            assert report.instance == w.instance
            async with Client(nc=router, namespace=ns) as c:  # a router submits jobs too
                r = req("fake")
                await c.complete(r)
                assert [t.instance for t in await trace_records(js, names, r.request_id)] == [w.instance]
            with pytest.raises(NotPermitted, match="ctl.m.fake.sleep: that needs admin credentials"):
                with anyio.fail_after(3):
                    await ask(router, names, "sleep", codec.encode(SleepRequest()), model="fake")
            body = codec.encode(SleepRequest())
            (slept,) = await ask(admin, names, "sleep", body, model="fake", timeout=10)
            assert isinstance(slept, ControlDone) and w.state == "sleeping", slept
            (woke,) = await ask(admin, names, "wake", instance=w.instance, timeout=10)
            assert isinstance(woke, ControlDone) and w.state == "serving", woke
        finally:
            await router.close()
            await admin.close()
    refusals = only_expected(secured.refusals_since(start))
    assert refusals == [
        '"JETLLM/user:router" - Publish Violation - Subject "jetllm.' + ns + '.ctl.m.fake.sleep"'
    ]


async def test_a_worker_relays_kv_events_that_a_router_replays_and_asks_to_resync(secured, ns, tmp_path):
    from .test_kvevents import EnginePublisher, stored

    start = secured.log_offset()
    engine_pub = EnginePublisher(tmp_path)
    router = await connect(secured.url("router"))
    names = Names(ns)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine_pub.serve_replay)
            engine = FakeEngine()
            engine.facts.kv_events = {0: engine_pub.source}
            async with inproc_worker(secured.url("worker"), engine, namespace=ns, instance="kv-1"):
                await kv_batches(router, names, "fake", "kv-1", lambda b: len(b) >= 1)
                await engine_pub.send(0, stored([11], None, [1, 2, 3, 4]))
                await kv_batches(router, names, "fake", "kv-1", lambda b: len(b) >= 2)
                (reply,) = await ask(router, names, "kv-resync", model="fake", timeout=10)
                assert isinstance(reply, ControlDone), reply
                got = await kv_batches(router, names, "fake", "kv-1", lambda b: len(b) >= 3)
                assert got[-1].resync is not None and got[-1].resync.reason == "requested"
            tg.cancel_scope.cancel()
    finally:
        engine_pub.close()
        await router.close()
    assert only_expected(secured.refusals_since(start)) == []


async def test_admin_reads_dead_letters_and_serves_adapters_a_producer_cannot_touch(secured, ns, tmp_path):
    allowed = tmp_path / "adapters"
    tinymodel.build_lora(allowed / "a", seed=1)
    engine = FakeEngine(max_model_len=64)
    engine.facts.lora = TINY_FACTS
    settings = LoraSettings(dirs=[str(allowed)], cache_dir=str(tmp_path / "cache"), load_wait=5)
    async with inproc_worker(secured.url("worker"), engine, namespace=ns, lora=settings):
        admin = await connect(secured.url("admin"))
        try:
            async with Client(secured.url("alice"), namespace=ns) as c:
                with pytest.raises(RequestFailed) as info:  # the worker dead-letters it
                    await c.complete(req("fake", list(range(3, 100))))
                assert info.value.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
                with pytest.raises(NotPermitted, match="that needs admin credentials"):
                    await deadletters.entries(c.nc, c.names)
                with pytest.raises(NotPermitted, match="LORA: that needs worker or admin credentials"):
                    await LoraAdmin(c.nc, c.names, timeout=5).load("fake", "a", source="path", ref="x")
                lora = LoraAdmin(admin, c.names, timeout=10)
                pushed = await lora.push(tinymodel.build_lora(tmp_path / "c", seed=2), "c")
                out = await lora.load("fake", "c", source="object", ref="c")
                assert out.replies[0].adapter.sha256 == pushed.sha256, out
                assert len((await c.complete(req("fake", adapter="c"))).token_ids) == 8
            (letter,) = await deadletters.entries(admin, Names(ns))
            assert letter.record.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
        finally:
            await admin.close()


async def test_every_refusal_is_one_clear_error_at_once_and_the_connection_lives_on(secured, ns):
    names = Names(ns)
    admin = await connect(secured.url("admin"))
    js = admin.jetstream()
    await ensure_registry(js, names)
    await ensure_lora_bucket(js, names)
    await admin.close()
    nc = await connect(secured.url("alice"))
    js = nc.jetstream(timeout=10)
    registry = await js.key_value(names.registry_bucket)
    lora = await js.key_value(names.lora_bucket)
    advisory = names.max_deliveries_advisory("generate", "fake")
    forged = names.request_log("someone-elses-request")  # a result written there would be believed

    async def publish(subject: str) -> None:
        async with checked(nc, "publish", subject):
            await nc.publish(subject, b"{}")

    async def subscribe(subject: str) -> None:
        async with checked(nc, "subscribe", subject):
            await nc.subscribe(subject)

    refusals = [
        # (what a producer tries, what the error says)
        (lambda: ask(nc, names, "sleep", model="fake"), "ctl.m.fake.sleep: that needs admin"),
        (lambda: ask(nc, names, "lora-load", instance="w1"), "ctl.i.w1.lora-load: that needs admin"),
        (lambda: ask(nc, names, "tasks", instance="w1"), "ctl.i.w1.tasks: that needs admin"),  # names requests
        (lambda: lora.put("fake.a", b"{}"), f"$KV.{names.lora_bucket}.fake.a: that needs admin"),
        (lambda: registry.put("i.w1", b"{}"), "that needs worker or admin credentials"),
        (lambda: publish(advisory), f"publish to {advisory}: no jetllm role may"),
        (lambda: publish(names.dlq("generate", "fake")), "that needs worker or admin"),
        (lambda: js.publish(forged, b"{}"), f"publish to {forged}: that needs worker or admin"),
        (lambda: subscribe("_INBOX.bob.>"), "receives only under its own inbox prefix"),
        (lambda: subscribe(names.cancel_all), f"subscribe to {names.cancel_all}: that needs worker or admin"),
        (lambda: js.delete_stream(names.jobs_stream), f"STREAM.DELETE.{names.jobs_stream}: that needs admin"),
        (lambda: js.publish(Names("elsewhere").jobs("generate", "fake"), b"{}"), "for namespace 'elsewhere'"),
    ]  # fmt: skip
    try:
        for attempt, says in refusals:
            with pytest.raises(NotPermitted) as info, anyio.fail_after(3):
                await attempt()
            assert info.value.message.startswith("not permitted: user 'alice' may not "), info.value
            assert says in info.value.message, info.value.message
        await js.account_info()  # still connected, still allowed what it may
    finally:
        await nc.close()


def jetllm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jetllm", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, **(env or {})},
    )


async def test_a_command_run_with_too_little_credentials_says_which_it_needs(secured, ns):
    admin = await connect(secured.url("admin"))
    await ensure_streams(admin.jetstream(), Names(ns), QueuePolicy())
    await admin.close()
    alice = secured.url("alice")
    out = jetllm("ctl", "sleep", "--model", "fake", "--nats", alice, "--namespace", ns, "--timeout", "5")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"jetllm ctl: not permitted: user 'alice' may not publish to jetllm.{ns}.ctl.m.fake.sleep: "
        f"that needs admin credentials for namespace {ns!r}"
    ]
    env = {"NATS_USER": "alice", "NATS_PASSWORD": secured.passwords["alice"]}
    out = jetllm("dlq", "list", "--nats", secured.url(), "--namespace", ns, env=env)
    assert out.returncode == 1 and "that needs admin credentials" in out.stderr, out.stderr
    assert secured.passwords["alice"] not in out.stderr + out.stdout


async def test_wrong_credentials_fail_at_once_without_showing_the_password(secured, ns):
    names = Names(ns)
    for url, who in [
        (secured.url("alice", "not-the-password-x1"), "user 'alice'"),
        (secured.url(), "this connection (no credentials)"),
    ]:
        with pytest.raises(ConnectRefused) as info, anyio.fail_after(5):
            await connect(url)
        assert f"the server refused the credentials of {who}" in str(info.value)
        assert "not-the-password-x1" not in str(info.value)
    nc = await connect(secured.url("alice"))  # a worker started with a producer's credentials
    try:
        worker = Worker(nc, FakeEngine(), WorkerConfig(namespace=names.namespace))
        with (
            anyio.fail_after(10),
            pytest.raises(NotPermitted, match="that needs worker or admin credentials"),
        ):
            await worker.serve(handle_signals=False)
    finally:
        await nc.close()


async def test_workers_by_password_and_by_nkey_hand_requests_over_and_never_log_a_secret(
    secured, ns, tmp_path
):
    """The migration path uses the most of every identity (the producer's ping, nak and answer to the
    resume question; the worker's takeover): it works, the server refuses nothing, and neither the
    password nor the seed is in the workers' logs; a worker with a wrong password stops at once."""
    start = secured.log_offset()
    seed = secured.seed_file.read_text().strip()
    by_password = FakeWorkerProcess(
        secured.url("worker"), ns, tmp_path / "pw.log", "--step-delay", "0.02", "--checkpoint-interval", "600"
    )
    by_nkey = FakeWorkerProcess(
        secured.url(), ns, tmp_path / "nk.log", "--step-delay", "0.02", "--checkpoint-interval", "600",
        env={"NATS_NKEY": str(secured.seed_file)},
    )  # fmt: skip
    wrong = FakeWorkerProcess(secured.url("worker", "wrong-pw-x2"), ns, tmp_path / "wrong.log")
    try:
        workers = {}
        for w in (by_password, by_nkey):
            workers[await w.wait_ready(secured.url("admin"), timeout=30)] = w
        async with Client(secured.url("alice"), namespace=ns) as c:
            prompt = [2, 7, 1]
            frames, killed = await collect_until_kill(c, req("fake", prompt, max_tokens=100), workers, 30)
        assert len(killed) == 1
        assert [f.attempt for f in frames if isinstance(f, AcceptedFrame)] == [1, 2]
        assert isinstance(frames[-1], FinalFrame)
        tokens = [t for f in frames if isinstance(f, TokensFrame) for t in f.token_ids]
        assert tokens == expected_tokens(prompt, 100)
        assert wrong.wait(timeout=30) != 0
    finally:
        for w in (by_password, by_nkey, wrong):
            w.stop()
    assert only_expected(secured.refusals_since(start)) == []
    logs = {p.name: p.read_text() for p in tmp_path.glob("*.log")}
    assert "serving" in logs["pw.log"] and "serving" in logs["nk.log"]
    assert "refused the credentials of user 'worker'" in logs["wrong.log"]
    for name, text in logs.items():
        for secret in (secured.passwords["worker"], seed, "wrong-pw-x2"):
            assert secret not in text, (name, "a secret is in the log")


async def test_a_request_to_a_refused_subject_fails_before_its_timeout(secured, ns):
    nc = await connect(secured.url("bob"))
    try:
        with anyio.fail_after(1), pytest.raises(NotPermitted, match="needs router or admin"):
            await nc.request(Names(ns).control("status"), b"", timeout=30)
        with pytest.raises(nats.errors.NoRespondersError):  # what it may do still works
            await nc.request(Names(ns).instance_control("nobody", "ping"), b"", timeout=5)
    finally:
        await nc.close()


async def test_producers_submit_through_a_router_fleet_running_as_the_router_identity(secured, ns):
    """The routing queue under per-role users: a router makes it and places jobs from it, a
    producer publishes to it (Client(via_routers=True)) and a gateway reads queue depth."""
    from jetllm.router import Router
    from jetllm.router.service import serve

    start = secured.log_offset()
    names = Names(ns)
    async with inproc_worker(secured.url("worker"), FakeEngine(), namespace=ns):
        router_nc = await connect(secured.url("router"))
        router = Router("fake", name="r1")
        try:
            async with anyio.create_task_group() as tg:
                await router.start(router_nc, names)
                ready = anyio.Event()
                tg.start_soon(lambda: serve(router_nc, names, router, ready=ready))
                with anyio.fail_after(10):
                    await ready.wait()
                async with Client(secured.url("alice"), namespace=ns, via_routers=True) as c:
                    done = await c.complete(req("fake", [3, 1, 4], max_tokens=6))
                    assert done.token_ids == expected_tokens([3, 1, 4], 6)
                assert router.stats.decisions >= 1
                info = await router_nc.jetstream().consumer_info(
                    names.jobs_stream, names.consumer("generate", "fake")
                )
                assert info.num_pending == 0
                tg.cancel_scope.cancel()
        finally:
            await router.close()
            await router_nc.close()
    assert only_expected(secured.refusals_since(start)) == []
