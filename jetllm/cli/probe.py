"""`jetllm health --local`: a container's exec probe, asking the workers of this host over NATS.

The workers of this host are the live registry records whose `host` is this host's name (in a pod:
the pod's name), so the probe needs no instance id passed to it. Each is asked the `health` verb
on its own subject.

Readiness (the default) passes when every local worker that answers is healthy and serving: a
worker that is starting, asleep or draining takes no jobs, and a rollout or a disruption budget
should count it as unavailable. Liveness (`--liveness`) passes while the engine is alive in any
state, and also when NATS or JetStream cannot be asked at all: the probe then knows nothing about
the worker, and restarting every worker for an outage of the message plane would only add model
loads to it. A worker that NATS can be asked about but that does not answer fails both.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from ..producer.fleet import ControlReply, ask
from ..producer.registry import instances
from ..schemas import HealthCheck, HealthReport
from ..subjects import codec
from ..subjects.connection import connect
from ..subjects.names import Names

_UNREACHABLE = (
    ConnectionError,
    TimeoutError,
    nats.errors.Error,  # no responders, timeouts, a closed connection
    nats.js.errors.Error,  # JetStream unavailable (no quorum, not enabled)
)


class Unknown(Exception):
    """NATS or the registry could not be asked: nothing is known about the worker."""


@dataclass
class Answer:
    instance: str
    reply: ControlReply | None
    """None: the instance was listed but did not answer in time."""


def passes(reply: ControlReply | None, *, liveness: bool) -> bool:
    """Whether one worker's answer passes the probe."""
    if not isinstance(reply, HealthReport):
        return False
    if liveness:
        return reply.engine_alive
    return reply.healthy and reply.state == "serving"


REACH_TIMEOUT = 10.0
"""Seconds to connect and read the registry; past them nothing is known about the worker. Each
local worker then gets `--timeout` to answer, so an exec probe needs a timeout above the sum."""


async def _local_instances(nc: NATS, names: Names, host: str) -> list[str]:
    try:
        records = await instances(nc.jetstream(timeout=5), names)
    except _UNREACHABLE as exc:
        raise Unknown(f"the registry cannot be read: {type(exc).__name__}: {exc}") from None
    return [r.instance for r in records if r.host == host]


async def _reach(url: str, names: Names, host: str) -> tuple[NATS, list[str]]:
    """A connection and this host's instances; raises Unknown past REACH_TIMEOUT or on failure."""
    nc: NATS | None = None
    try:
        with anyio.fail_after(REACH_TIMEOUT):
            nc = await connect(url, name="jetllm-probe", allow_reconnect=False, max_reconnect_attempts=1)
            return nc, await _local_instances(nc, names, host)
    except (ConnectionError, TimeoutError, Unknown) as exc:
        if nc is not None:
            await nc.close()
        raise Unknown(str(exc) or f"no answer from NATS within {REACH_TIMEOUT:.0f}s") from None


async def ask_local(url: str, names: Names, check: HealthCheck, *, host: str, timeout: float) -> list[Answer]:
    """Every live local worker's answer to `health` (one that vanished meanwhile is left out);
    raises Unknown when NATS or the registry cannot be asked."""
    nc, local = await _reach(url, names, host)
    try:
        body = codec.encode(check)
        answers = []
        for instance in local:
            try:
                (reply,) = await ask(nc, names, "health", body, instance=instance, timeout=timeout)
            except LookupError:
                continue  # its record outlived it by a few seconds
            except nats.errors.TimeoutError:
                reply = None
            except nats.errors.Error as exc:  # the connection went: the worker was not asked
                raise Unknown(f"{type(exc).__name__}: {exc}") from None
            answers.append(Answer(instance, reply))
        return answers
    finally:
        await nc.close()


async def probe(
    url: str,
    names: Names,
    check: HealthCheck,
    *,
    liveness: bool,
    timeout: float,
    host: str | None = None,
    json: bool = False,
) -> int:
    """Exit code of `jetllm health --local`: 0 when at least one local worker answered and all
    that did pass (or, for liveness, when NATS cannot be asked)."""
    host = host or socket.gethostname()
    try:
        answers = await ask_local(url, names, check, host=host, timeout=timeout)
    except Unknown as exc:
        what = str(exc)
        if liveness:
            print(f"cannot ask NATS about this host's worker ({what}): not judging it", file=sys.stderr)
            return 0
        print(f"not ready: {what}", file=sys.stderr)
        return 1
    if not answers:
        print(f"no worker of host {host!r} in namespace {names.namespace!r} answers", file=sys.stderr)
        return 1
    for a in answers:
        ok = passes(a.reply, liveness=liveness)
        if json:
            reply = a.reply or {"instance": a.instance, "error": "no answer in time"}
            print(msgspec.json.encode(reply).decode())
        elif isinstance(a.reply, HealthReport):
            r = a.reply
            print(
                f"{a.instance} {'pass' if ok else 'FAIL'}: state={r.state} "
                f"engine={'up' if r.engine_alive else 'DEAD'} healthy={r.healthy}"
                + (f" last_error={r.last_error}" if r.last_error else "")
            )
        else:
            why = "no answer in time" if a.reply is None else getattr(a.reply, "message", a.reply)
            print(f"{a.instance} FAIL: {why}")
    return 0 if all(passes(a.reply, liveness=liveness) for a in answers) else 1
