"""A GPU box behind a leaf node: its worker connects to a local nats-server started with
infra/nats/leaf.conf, which dials the hub; producers on the hub get its jobs done."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from jetllm.cli.probe import probe
from jetllm.natsserver import find_binary, free_port
from jetllm.producer import Client
from jetllm.producer.registry import instances
from jetllm.schemas import HealthCheck
from jetllm.subjects.connection import connect
from jetllm.subjects.names import Names

from .conftest import FakeWorkerProcess
from .jobs import req

pytestmark = pytest.mark.anyio

LEAF_CONF = Path(__file__).resolve().parent.parent / "infra" / "nats" / "leaf.conf"


def hub_domain() -> str:
    """The JetStream domain leaf.conf addresses its mappings to."""
    (domain,) = set(re.findall(r'"\$JS\.([A-Za-z0-9_-]+)\.API\.', LEAF_CONF.read_text()))
    return domain


class Server:
    def __init__(self, conf: Path, port: int, log: Path, env: dict[str, str] | None = None) -> None:
        self.url = f"nats://127.0.0.1:{port}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [find_binary(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        deadline = time.monotonic() + 20
        while True:
            assert self.proc.poll() is None, log.read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def hub_and_leaf(tmp_path) -> Iterator[tuple[str, str]]:
    leaf_port = free_port()
    hub_conf = tmp_path / "hub.conf"
    hub_conf.write_text(
        "server_name: hub\nmax_payload: 8MB\n"
        f'jetstream {{ store_dir: "{tmp_path / "js"}", domain: {hub_domain()} }}\n'
        f"leafnodes {{ listen: 127.0.0.1:{leaf_port} }}\n"
    )
    hub = Server(hub_conf, free_port(), tmp_path / "hub.log")
    try:
        env = {"JETLLM_HUB_LEAF_URL": f"nats-leaf://127.0.0.1:{leaf_port}"}
        leaf = Server(LEAF_CONF, free_port(), tmp_path / "leaf.log", env)
        try:
            yield hub.url, leaf.url
        finally:
            leaf.stop()
    finally:
        hub.stop()


async def wait_for_hub_jetstream(leaf_url: str) -> None:
    """Until the leaf connection is up: the hub's JetStream answers through the leaf."""
    nc = await connect(leaf_url)
    try:
        with anyio.fail_after(20):
            while True:
                try:
                    await nc.jetstream(timeout=1).account_info()
                    return
                except Exception:
                    await anyio.sleep(0.1)
    finally:
        await nc.close()


async def test_a_worker_behind_a_leaf_node_serves_producers_on_the_hub(hub_and_leaf, namespace, tmp_path):
    hub_url, leaf_url = hub_and_leaf
    await wait_for_hub_jetstream(leaf_url)
    worker = FakeWorkerProcess(leaf_url, namespace, tmp_path / "worker.log")
    try:
        instance = await worker.wait_ready(hub_url, timeout=30)  # its status reaches the hub
        async with Client(hub_url, namespace=namespace) as c:
            with anyio.fail_after(30):
                done = await c.complete(req("fake", [4, 2], max_tokens=20))
            assert len(done.token_ids) == 20 and done.finish_reason == "length" and done.worker == instance
            # Its registry record (a KV write through the leaf) reaches the hub's bucket.
            with anyio.fail_after(10):
                while [r.instance for r in await instances(c.js, Names(namespace))] != [instance]:
                    await anyio.sleep(0.1)
        # The pod's probe works from the box too, through the leaf.
        assert (
            await probe(leaf_url, Names(namespace), HealthCheck(canary=False), liveness=False, timeout=5) == 0
        )
    finally:
        worker.stop()
    assert "WARNING" not in worker.log_path.read_text(), worker.log_tail()
