"""The first connection to NATS: it gives up on a server that never answers, when told to."""

from __future__ import annotations

import socket

import anyio
import pytest

from jetllm.subjects.connection import connect
from jetllm.workers.main import connect_waiting

pytestmark = pytest.mark.anyio


def dead_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_worker_gives_up_on_an_unreachable_server_after_its_nats_wait_naming_the_url():
    url = f"nats://alice:secret-pw-x3@127.0.0.1:{dead_port()}"
    with anyio.fail_after(20), pytest.raises(ConnectionError) as info:
        await connect_waiting(url, 1.0, name="test")
    text = str(info.value)
    assert text.startswith(f"cannot connect to NATS at nats://***@127.0.0.1:{url.rsplit(':', 1)[1]}: ")
    assert "no server answered within 1s" in text and "--nats-wait" in text
    assert "secret-pw-x3" not in text and "alice" not in text


async def test_without_a_wait_the_first_connection_keeps_trying_until_the_server_is_up(tmp_path):
    from jetllm.natsserver import NatsServer

    port = dead_port()
    server = NatsServer(tmp_path / "nats", port=port)

    async def start_later() -> None:
        await anyio.sleep(1.5)
        await anyio.to_thread.run_sync(server.__enter__)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(start_later)
            with anyio.fail_after(30):
                nc = await connect(f"nats://127.0.0.1:{port}", wait=20)
            assert nc.is_connected
            await nc.close()
    finally:
        server.__exit__(None, None, None)


async def test_a_client_closes_without_an_error_while_its_server_is_away(tmp_path, caplog):
    """`jetllm batch` closes its client once every line is written: a server restarting just then
    must not turn the finished batch into a failure."""
    from jetllm.natsserver import NatsServer
    from jetllm.producer import Client

    server = NatsServer(tmp_path / "nats").start()
    with anyio.fail_after(10):
        async with Client(server.url, namespace="t"):
            server.stop()
            await anyio.sleep(0.5)  # the connection is reconnecting now
    assert "closing the NATS connection" in caplog.text
