"""Fixtures for tests on a three-node JetStream cluster on loopback (tests/test_cluster.py).

Registered as a plugin in tests/conftest.py: `nats_cluster` starts the cluster for one test (its
members can be killed and restarted at will), `start_cluster_worker` starts fake-engine worker
processes on it with `--replicas 3`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.js import JetStreamContext

from jetllm.natsserver import NatsCluster

from ..conftest import FakeWorkerProcess, stop_all


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """Three nats-servers (n1, n2, n3) forming one JetStream cluster; `.url` names all three."""
    with NatsCluster(tmp_path / "cluster") as cluster:
        yield cluster


@pytest.fixture
def start_cluster_worker(nats_cluster: NatsCluster, tmp_path: Path):
    """Factory: a fake-engine worker process that stores everything with 3 replicas, connected to
    `url` (default: every member of the cluster); all are stopped after the test."""
    started: list[FakeWorkerProcess] = []

    def start(namespace: str, *args: str, url: str | None = None) -> FakeWorkerProcess:
        w = FakeWorkerProcess(
            url or nats_cluster.url,
            namespace,
            tmp_path / f"cluster-worker{len(started)}.log",
            "--replicas",
            "3",
            "--grace-period",
            "5",
            *args,
        )
        started.append(w)
        return w

    yield start
    stop_all(started)


async def stream_leader(js: JetStreamContext, stream: str) -> str:
    """The member that leads `stream` now (it orders and acknowledges every write to it)."""
    info = await js.stream_info(stream)
    if info.cluster is None or not info.cluster.leader:
        raise AssertionError(f"stream {stream} has no leader: {info.cluster}")
    return info.cluster.leader
