"""TLS between jetllm and nats-server, with certificates made here (trustme): workers and producers
over `tls://`, clear errors for a missing CA or client certificate, and never plaintext where TLS
was asked for."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
import trustme

from jetllm.errors import ConnectRefused, InsecureConnection
from jetllm.natsserver import NatsServer
from jetllm.producer import Client
from jetllm.subjects.connection import Security, connect
from jetllm.subjects.natsconfig import tls_config

from .conftest import inproc_worker
from .fake_engine import FakeEngine
from .jobs import req

pytestmark = pytest.mark.anyio


@dataclass
class Pki:
    ca: Path
    client_cert: Path
    client_key: Path
    tls: NatsServer
    """Encrypted, any client."""
    mutual: NatsServer
    """Encrypted, clients must show a certificate signed by the CA."""


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Iterator[Pki]:
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.cert_chain_pems[0].write_to_path(str(d / "server.pem"))
    server.private_key_pem.write_to_path(str(d / "server.key"))
    client = ca.issue_cert("worker-1.jetllm.test")
    client.cert_chain_pems[0].write_to_path(str(d / "client.pem"))
    client.private_key_pem.write_to_path(str(d / "client.key"))
    cert, key, ca_file = str(d / "server.pem"), str(d / "server.key"), str(d / "ca.pem")
    tls = NatsServer(d / "tls", extra_config=tls_config(cert, key), tls=True)
    mutual = NatsServer(d / "mutual", extra_config=tls_config(cert, key, ca_file, verify=True), tls=True)
    with tls, mutual:
        yield Pki(d / "ca.pem", d / "client.pem", d / "client.key", tls, mutual)


async def test_a_worker_and_a_producer_talk_over_tls(pki, namespace, monkeypatch):
    monkeypatch.setenv("NATS_CA", str(pki.ca))
    monkeypatch.setenv("JETLLM_REQUIRE_TLS", "1")
    async with inproc_worker(pki.tls.url, FakeEngine(), namespace=namespace) as w:
        assert w.nc._transport._io_writer.get_extra_info("ssl_object") is not None
        async with Client(pki.tls.url, namespace=namespace) as c:
            assert c.nc._transport._io_writer.get_extra_info("ssl_object") is not None
            assert len((await c.complete(req("fake"))).token_ids) == 8


async def test_a_client_without_the_ca_is_told_to_name_it(pki):
    with anyio.fail_after(5), pytest.raises(ConnectRefused) as info:
        await connect(pki.tls.url, security=Security())
    text = str(info.value)
    assert text.startswith(
        f"cannot connect to NATS at {pki.tls.url}: the server's TLS certificate is not trusted"
    )
    assert "--nats-ca or NATS_CA" in text


async def test_mutual_tls_needs_the_client_certificate_and_takes_it(pki):
    with anyio.fail_after(5), pytest.raises(ConnectRefused, match="--nats-cert and --nats-key"):
        await connect(pki.mutual.url, security=Security(ca=str(pki.ca)))
    sec = Security(ca=str(pki.ca), cert=str(pki.client_cert), key=str(pki.client_key))
    nc = await connect(pki.mutual.url, security=sec)
    try:
        await nc.jetstream().account_info()
    finally:
        await nc.close()


async def test_a_tls_url_never_falls_back_to_plaintext(nats_url):
    """nats-py alone would send CONNECT (and any password) in the clear to a tls:// URL whose server
    does not start TLS; jetllm refuses before anything leaves."""
    url = nats_url.replace("nats://", "tls://u:secret-pw@")
    with anyio.fail_after(5), pytest.raises(InsecureConnection, match="did not start TLS") as info:
        await connect(url)
    assert "secret-pw" not in str(info.value)


def test_a_worker_told_to_require_tls_refuses_a_plain_url():
    out = subprocess.run(
        [sys.executable, "-m", "jetllm", "worker", "--require-tls", "--nats", "nats://127.0.0.1:4222"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "jetllm worker: TLS is required (--require-tls), but nats://127.0.0.1:4222 is not a TLS URL: "
        "use tls://host:port, with --nats-ca (NATS_CA) naming the CA that signed the server's certificate"
    )
