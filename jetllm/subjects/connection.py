"""Connecting to NATS with settings fit for long-lived workers and producers."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from nats.aio.client import Client as NATS

log = logging.getLogger(__name__)

DEFAULT_URL = "nats://127.0.0.1:4222"
_USERINFO = re.compile(r"(?<=://)[^/@]+@")


def redact(url: str) -> str:
    """A server URL fit for logs: credentials replaced by `***`."""
    return ",".join(_USERINFO.sub("***@", u) for u in url.split(","))


def default_url() -> str:
    return os.environ.get("NATS_URL") or DEFAULT_URL


async def connect(url: str | None = None, *, name: str = "jetllm", **options: Any) -> NATS:
    """Connect with reconnects forever; credentials may come in the URL or `NATS_CREDS`."""
    url = url or default_url()
    servers = [u.strip() for u in url.split(",") if u.strip()]

    async def on_error(exc: Exception) -> None:
        log.warning("nats: %s", exc)

    nc = NATS()

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
    )
    creds = os.environ.get("NATS_CREDS")
    if creds:
        opts["user_credentials"] = creds
    opts.update(options)
    try:
        await nc.connect(**opts)
        return nc
    except Exception as exc:
        raise ConnectionError(f"cannot connect to NATS at {redact(url)}: {exc}") from None
