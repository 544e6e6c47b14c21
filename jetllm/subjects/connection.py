"""Connecting to NATS with settings fit for long-lived workers and producers, as the identity and
with the TLS settings the environment gives (every `jetllm` command's flags set the same variables):

| variable | meaning |
|---|---|
| `NATS_CREDS` | a credentials file (`.creds`: a user JWT and its nkey seed) |
| `NATS_NKEY` | a file holding an nkey seed (`SU...`) |
| `NATS_USER`, `NATS_PASSWORD` | user and password (or in the URL: `nats://user:password@host`) |
| `NATS_CA` | CA certificate(s) that signed the server's certificate, for `tls://` URLs |
| `NATS_CERT`, `NATS_KEY` | a client certificate and its key, for servers that require one |
| `NATS_INBOX_PREFIX` | where replies come (default: `_INBOX.<user name or nkey>` with credentials) |
| `JETLLM_REQUIRE_TLS` | `1`: refuse any URL that is not `tls://` |

Secrets go to nats-py and nowhere else: URLs are logged through `redact`, and errors name the
variable or file, never its content. A connection to a `tls://` URL sends nothing (credentials
included) unless the server really started TLS: nats-py alone would go on in the clear.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import anyio
from nats.aio.client import Client as NATS

from ..errors import ConnectRefused, InsecureConnection, JetllmError, NatsSettingsError
from .denials import Denials
from .permissions import inbox_prefix

log = logging.getLogger(__name__)

DEFAULT_URL = "nats://127.0.0.1:4222"
_USERINFO = re.compile(r"(?<=://)[^/@]+@")
_TLS_SCHEMES = ("tls", "wss")
_TRUE = ("1", "true", "yes", "on")


def redact(url: str) -> str:
    """A server URL fit for logs: credentials replaced by `***`."""
    return ",".join(_USERINFO.sub("***@", u) for u in url.split(","))


def default_url() -> str:
    return os.environ.get("NATS_URL") or DEFAULT_URL


def servers_of(url: str) -> list[str]:
    return [u.strip() for u in url.split(",") if u.strip()]


@dataclass(frozen=True)
class Security:
    """Who a connection authenticates as, and how it is encrypted."""

    creds: str | None = None
    nkey: str | None = None
    """Path of a file holding an nkey seed."""
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    require_tls: bool = False
    inbox_prefix: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Security:
        env = os.environ if env is None else env
        return cls(
            creds=env.get("NATS_CREDS") or None,
            nkey=env.get("NATS_NKEY") or None,
            user=env.get("NATS_USER") or None,
            password=env.get("NATS_PASSWORD") or None,
            ca=env.get("NATS_CA") or None,
            cert=env.get("NATS_CERT") or None,
            key=env.get("NATS_KEY") or None,
            require_tls=env.get("JETLLM_REQUIRE_TLS", "").lower() in _TRUE,
            inbox_prefix=env.get("NATS_INBOX_PREFIX") or None,
        )

    def check(self, servers: list[str]) -> None:
        """Refuse settings that cannot be what was meant, naming them."""
        given = [
            n
            for n, v in (("NATS_CREDS", self.creds), ("NATS_NKEY", self.nkey), ("NATS_USER", self.user))
            if v
        ]
        if len(given) > 1:
            raise NatsSettingsError(f"{' and '.join(given)} are both set: give one way to authenticate")
        if (self.user is None) != (self.password is None):
            raise NatsSettingsError("NATS_USER and NATS_PASSWORD go together: set both, or neither")
        if self.user is not None and url_user(servers) is not None:
            raise NatsSettingsError("credentials are both in the URL and in NATS_USER: give them once")
        if (self.cert is None) != (self.key is None):
            raise NatsSettingsError("a client certificate needs its key: set NATS_CERT and NATS_KEY together")
        for var, path in (("NATS_CREDS", self.creds), ("NATS_NKEY", self.nkey), ("NATS_CA", self.ca),
                          ("NATS_CERT", self.cert), ("NATS_KEY", self.key)):  # fmt: skip
            if path is not None and not os.path.isfile(path):
                raise NatsSettingsError(f"{var}={path}: no such file")
        if self.require_tls:
            plain = [redact(s) for s in servers if _scheme(s) not in _TLS_SCHEMES]
            if plain:
                raise InsecureConnection(
                    f"TLS is required (--require-tls), but {', '.join(plain)} is not a TLS URL: "
                    "use tls://host:port, with --nats-ca (NATS_CA) naming the CA that signed the "
                    "server's certificate"
                )

    def wants_tls(self, servers: list[str]) -> bool:
        return self.require_tls or any(_scheme(s) in _TLS_SCHEMES for s in servers)


def _scheme(server: str) -> str:
    return server.split("://", 1)[0].lower() if "://" in server else "nats"


def url_user(servers: list[str]) -> str | None:
    for s in servers:
        try:
            user = urlparse(s).username
        except ValueError:
            continue
        if user:
            return user
    return None


def nkey_public_key(seed_file: str) -> str:
    """The public key of the seed in `seed_file` (the seed itself stays in this function)."""
    try:
        import nkeys
    except ImportError:
        raise NatsSettingsError("NATS_NKEY needs the nkeys package: pip install nkeys") from None
    with open(seed_file, "rb") as f:
        seed = bytearray(f.read().strip())
    try:
        return nkeys.from_seed(seed).public_key.decode()
    except Exception:
        raise NatsSettingsError(f"NATS_NKEY={seed_file}: not an nkey seed file") from None
    finally:
        seed[:] = b"\0" * len(seed)


def identity(sec: Security, servers: list[str]) -> str | None:
    """What names this connection to the server, if anything: a user name or an nkey public key
    (what the server's permissions, and so the inbox prefix, are written for)."""
    if sec.user:
        return sec.user
    if sec.nkey:
        return nkey_public_key(sec.nkey)
    return url_user(servers)


def describe(sec: Security, who: str | None) -> str:
    """The identity as errors name it."""
    if sec.creds:
        return f"the user of {os.path.basename(sec.creds)}"
    if sec.nkey and who:
        return f"nkey {who}"
    return f"user {who!r}" if who else "this connection (no credentials)"


def tls_context(sec: Security, servers: list[str]) -> ssl.SSLContext | None:
    if not (sec.wants_tls(servers) or sec.ca or sec.cert):
        return None
    ctx = ssl.create_default_context(cafile=sec.ca)
    if sec.cert and sec.key:
        ctx.load_cert_chain(sec.cert, sec.key)
    return ctx


class Connection(NATS):
    """nats-py's client with two guards: a refusal from the server fails the request that caused
    it at once (denials.py), and a connection meant to be TLS never sends CONNECT in the clear."""

    def __init__(self) -> None:
        super().__init__()
        self.denials = Denials(self)
        self.tls_expected = False

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        if reply:
            self.denials.sent(subject, reply)
        await super().publish(subject, payload, reply, headers)

    def _connect_command(self) -> bytes:
        if self.tls_expected and not _is_tls(self):
            server = self._current_server.uri.geturl() if self._current_server else "the server"
            raise InsecureConnection(
                f"{redact(server)} did not start TLS: jetllm sends nothing in the clear to a tls:// URL "
                "(or with --require-tls); enable TLS on the server, or use a nats:// URL"
            )
        return super()._connect_command()


def _is_tls(nc: NATS) -> bool:
    server = nc._current_server
    if server is not None and server.uri.scheme == "wss":  # the websocket library does TLS itself
        return True
    writer = getattr(nc._transport, "_io_writer", None)
    return writer is not None and writer.get_extra_info("ssl_object") is not None


class _GiveUp(Exception):
    """Raised from the error callback to end nats-py's connect loop; it catches OSError and its own
    errors (a ConnectionError would only be retried), not this."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _fatal(exc: Exception, url: str, who: str) -> ConnectRefused | None:
    """An error that no retry fixes (credentials refused, TLS refused), as the error to raise."""
    where = f"cannot connect to NATS at {redact(url)}"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return ConnectRefused(
            f"{where}: the server's TLS certificate is not trusted ({exc.verify_message}); "
            "name the CA that signed it with --nats-ca or NATS_CA"
        )
    if isinstance(exc, ssl.SSLError):
        return ConnectRefused(
            f"{where}: TLS failed ({exc.reason or exc}); a server that requires client certificates "
            "needs --nats-cert and --nats-key (NATS_CERT, NATS_KEY)"
        )
    text = str(exc).lower()
    if "authorization violation" in text or "authentication" in text:
        return ConnectRefused(
            f"{where}: the server refused the credentials of {who} (NATS_USER/NATS_PASSWORD, "
            "NATS_NKEY, NATS_CREDS, or the URL's user)"
        )
    return None


async def connect(
    url: str | None = None,
    *,
    name: str = "jetllm",
    security: Security | None = None,
    wait: float | None = None,
    **options: Any,
) -> Connection:
    """Connect with reconnects forever; wrong credentials or TLS settings fail at once.

    `wait`: seconds the first connection may take (None: no limit). nats-py alone retries a first
    connection to an unreachable server as long as it would reconnect: here, forever."""
    url = url or default_url()
    servers = servers_of(url)
    sec = security or Security.from_env()
    sec.check(servers)
    ident = identity(sec, servers)
    who = describe(sec, ident)
    nc = Connection()
    nc.denials.who = who
    nc.tls_expected = sec.wants_tls(servers)
    connected = False
    last_error: Exception | None = None

    refused_at = -60.0

    async def on_error(exc: Exception) -> None:
        nonlocal refused_at, last_error
        if nc.denials.handle(exc):
            return
        fatal = _fatal(exc, url, who)
        if fatal is None:
            last_error = exc
            log.warning("nats: %s", exc)
        elif not connected:
            raise _GiveUp(fatal)
        elif time.monotonic() - refused_at >= 60.0:  # reconnecting with credentials rotated away
            refused_at = time.monotonic()
            log.error("nats: %s; still trying to reconnect", fatal)

    async def on_disconnect() -> None:
        if not (nc.is_closed or nc.is_draining):
            log.warning("nats: disconnected from %s", redact(url))

    async def on_reconnect() -> None:
        log.info("nats: reconnected")

    opts: dict[str, Any] = dict(
        servers=servers,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        pending_size=8 * 1024 * 1024,
        **_auth_options(sec, servers, ident),
    )
    opts.update(options)
    try:
        with anyio.fail_after(wait):
            await nc.connect(**opts)
        connected = True
        if ident is not None or sec.creds or sec.inbox_prefix:
            await _check_inbox(nc)
        return nc
    except BaseException as exc:
        await _abandon(nc)
        failed = _connect_error(exc, url, None if connected else wait, last_error)
        if failed is exc:
            raise
        raise failed from None


def _connect_error(exc: BaseException, url: str, wait: float | None, last: Exception | None) -> BaseException:
    """What a failed connect raises; `wait`: the first connection's limit, which ran out on a
    TimeoutError."""
    if isinstance(exc, TimeoutError) and wait is not None:
        return ConnectionError(
            f"cannot connect to NATS at {redact(url)}: no server answered within {wait:g}s"
            f"{f' (last: {last})' if last else ''}; start it, check the URL, or wait longer "
            "(a worker's --nats-wait)"
        )
    if isinstance(exc, _GiveUp):
        return exc.error
    if isinstance(exc, (JetllmError, ConnectionError)) or not isinstance(exc, Exception):
        return exc
    return ConnectionError(f"cannot connect to NATS at {redact(url)}: {exc}")


def _auth_options(sec: Security, servers: list[str], ident: str | None) -> dict[str, Any]:
    opts: dict[str, Any] = {"inbox_prefix": sec.inbox_prefix or inbox_prefix(ident)}
    if sec.creds:
        opts["user_credentials"] = sec.creds
    if sec.nkey:
        opts["nkeys_seed"] = sec.nkey
    if sec.user:
        opts["user"], opts["password"] = sec.user, sec.password
    ctx = tls_context(sec, servers)
    if ctx is not None:
        opts["tls"] = ctx
    return opts


async def _check_inbox(nc: Connection) -> None:
    """Whether this identity may receive under its inbox prefix: a wrong prefix otherwise shows as
    every request timing out."""
    probe = nc.new_inbox()
    async with nc.denials.checked("subscribe", [probe]):
        sub = await nc.subscribe(probe)
    await sub.unsubscribe()


async def _abandon(nc: Connection) -> None:
    """Close what a failed connect left open. Before CONNECT went through only the socket is open (and
    a socket cut mid-handshake may never report closing, so nats-py's close would wait for it)."""
    try:
        if not nc.is_connected and nc._transport:
            nc._transport.close()
        else:
            await asyncio.wait_for(nc.close(), 2.0)
    except Exception:
        pass
