"""`jetllm health --local`: the exec probe a worker's pod runs, against fake-engine worker processes."""

from __future__ import annotations

import signal
import subprocess
import sys

import anyio
import pytest

from jetllm.natsserver import free_port
from jetllm.producer import Client
from jetllm.producer.fleet import ask
from jetllm.schemas import HealthCheck, HealthReport
from jetllm.subjects.connection import connect
from jetllm.subjects.names import Names

from .jobs import req

pytestmark = pytest.mark.anyio

NO_CANARY = HealthCheck(canary=False)


def health_local(url: str, namespace: str, *extra: str) -> subprocess.CompletedProcess:
    """The probe exactly as the pod runs it: a new process, no instance id given."""
    return subprocess.run(
        [sys.executable, "-m", "jetllm", "health", "--local", "--no-canary", "--timeout", "5", *extra]
        + ["--nats", url, "--namespace", namespace],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def in_thread(*args, **kw) -> subprocess.CompletedProcess:
    return await anyio.to_thread.run_sync(lambda: health_local(*args, **kw))


async def test_a_serving_worker_passes_both_probes_and_a_sleeping_one_is_alive_but_not_ready(
    nats_url, namespace, start_fake_worker
):
    w = start_fake_worker(namespace)
    instance = await w.wait_ready(nats_url, timeout=30)

    ready = await in_thread(nats_url, namespace)
    assert ready.returncode == 0, ready.stderr
    assert ready.stdout.splitlines() == [f"{instance} pass: state=serving engine=up healthy=True"]
    live = await in_thread(nats_url, namespace, "--liveness")
    assert live.returncode == 0, live.stderr

    nc = await connect(nats_url)
    try:
        await ask(nc, Names(namespace), "sleep", instance=instance, timeout=30)
        asleep = await in_thread(nats_url, namespace)
        assert asleep.returncode == 1 and "FAIL: state=sleeping engine=up" in asleep.stdout
        live = await in_thread(nats_url, namespace, "--liveness")
        assert live.returncode == 0 and "pass: state=sleeping" in live.stdout
        await ask(nc, Names(namespace), "wake", instance=instance, timeout=30)
    finally:
        await nc.close()
    assert (await in_thread(nats_url, namespace)).returncode == 0


async def test_a_draining_worker_is_not_ready_but_alive_until_it_exits(
    nats_url, namespace, start_fake_worker
):
    """SIGTERM (what Kubernetes sends first) drains: the pod leaves readiness at once, and liveness
    keeps passing through the drain, so the kubelet never kills a worker finishing its requests."""
    from jetllm.cli.probe import probe

    w = start_fake_worker(namespace, "--step-delay", "0.05", "--grace-period", "30")
    await w.wait_ready(nats_url, timeout=30)
    names = Names(namespace)
    async with Client(nats_url, namespace=namespace) as c:
        stream = c.generate(req("fake", max_tokens=400))
        await anext(stream)  # accepted: the worker holds the job
        w.signal(signal.SIGTERM)
        for _ in range(50):
            (report,) = await ask(c.nc, names, "health", instance=w.instance, timeout=5)
            assert isinstance(report, HealthReport)
            if report.state == "draining":
                break
            await anyio.sleep(0.1)
        else:
            pytest.fail(f"the worker never reported draining after SIGTERM:\n{w.log_tail()}")
        assert await probe(nats_url, names, NO_CANARY, liveness=False, timeout=5) == 1
        assert await probe(nats_url, names, NO_CANARY, liveness=True, timeout=5) == 0
        (report,) = await ask(c.nc, names, "health", instance=w.instance, timeout=5)
        assert report.state == "draining"  # both verdicts above were given during the drain
        await stream.aclose()


async def test_only_this_hosts_workers_count_and_none_fails_both_probes(
    nats_url, namespace, start_fake_worker
):
    from jetllm.cli.probe import probe

    names = Names(namespace)
    assert await probe(nats_url, names, NO_CANARY, liveness=False, timeout=5) == 1
    assert await probe(nats_url, names, NO_CANARY, liveness=True, timeout=5) == 1  # NATS is up: a verdict
    w = start_fake_worker(namespace)
    await w.wait_ready(nats_url, timeout=30)
    assert await probe(nats_url, names, NO_CANARY, liveness=False, timeout=5) == 0
    elsewhere = dict(liveness=True, timeout=5, host="another-pod")
    assert await probe(nats_url, names, NO_CANARY, **elsewhere) == 1


async def test_when_nats_cannot_be_reached_liveness_passes_and_readiness_fails(namespace):
    closed = f"nats://127.0.0.1:{free_port()}"
    live = await in_thread(closed, namespace, "--liveness")
    assert live.returncode == 0 and "not judging it" in live.stderr, live.stderr
    ready = await in_thread(closed, namespace)
    assert ready.returncode == 1 and "not ready: cannot connect to NATS" in ready.stderr, ready.stderr
    assert "Traceback" not in ready.stderr + live.stderr
