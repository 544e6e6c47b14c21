"""The NATS server a side connects to is checked before anything is created on it: too old a
server drops settings silently, and one without JetStream cannot hold a job."""

from __future__ import annotations

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from ..errors import JetStreamUnavailable, ServerTooOld

MIN_SERVER = (2, 10, 0)


def parse_version(text: str) -> tuple[int, int, int]:
    core = text.strip().lstrip("v").split("-")[0].split("+")[0]
    parts = (core.split(".") + ["0", "0"])[:3]
    try:
        return (int(parts[0]), int(parts[1]), int(parts[2]))
    except ValueError:
        raise ServerTooOld(f"cannot read the NATS server version {text!r}") from None


def check_version(text: str) -> None:
    if parse_version(text) < MIN_SERVER:
        raise ServerTooOld(
            f"nats-server {text} is too old: jetllm needs >= {'.'.join(map(str, MIN_SERVER))}, "
            "because older servers silently drop stream and consumer settings they do not know "
            "(filter_subjects, metadata, ...) instead of refusing them"
        )


async def check_server(nc: NATS) -> None:
    """Refuse servers that would silently misbehave; fail fast when JetStream is off."""
    v = nc.connected_server_version
    check_version(f"{v.major}.{v.minor}.{v.patch}")
    try:
        await nc.jetstream(timeout=5).account_info()
    except nats.js.errors.ServiceUnavailableError:
        raise JetStreamUnavailable(
            "the NATS server does not have JetStream enabled (start it with -js, or "
            "`jetstream {}` in its config)"
        ) from None
    except nats.errors.NoRespondersError:
        raise JetStreamUnavailable(
            "no JetStream API answered: JetStream is not enabled for this account/server"
        ) from None
