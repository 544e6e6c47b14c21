"""The server's permission refusals, turned into one clear error for the call that caused them.

A refused publish or subscribe is not an answer: the server drops it and reports
`permissions violation for publish to "<subject>"` on the connection's error channel, so a
request to a refused subject would otherwise wait out its timeout and a refused subscription would
simply stay silent. `Denials` (one per connection, fed by its error callback) fails the waiting
requests to that subject at once with `NotPermitted`, and `checked` confirms a subscribe or
publish with one round trip. Each error names the subject, the identity, and which access roles
may do it (permissions.py), so the way out is in the message.

It finds a request's future in nats-py's response map (`_resp_map`, `_resp_sub_prefix`); the
version range in pyproject.toml pins the client this was written against, and the tests run it.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

from ..errors import NotPermitted
from .names import Names
from .permissions import INBOX, namespace_of, roles_allowed

log = logging.getLogger(__name__)

_REFUSAL = re.compile(
    r'permissions violation for (publish|subscription) (?:to|with reply of) "([^"]+)"', re.IGNORECASE
)
_RECENT = 1024
"""Requests remembered by reply subject, to find the one a refusal belongs to (oldest dropped)."""
_WARN_EVERY = 60.0


def parse_refusal(text: str) -> tuple[str, str] | None:
    """("publish" | "subscribe", subject) of a server's permission refusal, None for other errors."""
    m = _REFUSAL.search(text)
    if m is None:
        return None
    return ("publish" if m.group(1).lower() == "publish" else "subscribe"), m.group(2)


def refusal_message(op: str, subject: str, who: str) -> str:
    """One line: what was refused, to whom, and who may do it."""
    verb = "publish to" if op == "publish" else "subscribe to"
    head = f"not permitted: {who} may not {verb} {subject}"
    if op == "subscribe" and subject.startswith(f"{INBOX}."):
        return (
            f"{head}: an identity receives only under its own inbox prefix, _INBOX.<user name or nkey>; "
            "jetllm takes it from the credentials, NATS_INBOX_PREFIX overrides it"
        )
    ns = namespace_of(subject)
    roles = roles_allowed(op, subject, Names(ns)) if ns is not None else []
    if not roles:
        return f"{head}: no jetllm role may (check the server's permissions for this identity)"
    needs = " or ".join(roles) if len(roles) < 3 else f"{', '.join(roles[:-1])} or {roles[-1]}"
    return f"{head}: that needs {needs} credentials for namespace {ns!r}"


class Denials:
    """Refusals on one connection, matched to the requests and checks waiting for them."""

    def __init__(self, nc: Any, who: str = "this connection") -> None:
        self.nc = nc
        self.who = who
        """The identity as errors name it: `user 'alice'`, `nkey U...`; never a secret."""
        self._sent: dict[str, str] = {}
        self._expected: list[tuple[set[tuple[str, str]], list[NotPermitted]]] = []
        self._warned: dict[tuple[str, str], float] = {}

    def sent(self, subject: str, reply: str) -> None:
        """A publish with a reply subject left: remember which, in case it is refused."""
        self._sent[reply] = subject
        if len(self._sent) > _RECENT:
            for old in list(self._sent)[: _RECENT // 2]:
                del self._sent[old]

    def handle(self, exc: Exception) -> bool:
        """Take a connection error; True when it was a refusal (then it has been dealt with).

        nats-py lower-cases the server's error text, so the refused subject is matched without
        case and named as the caller wrote it when a waiting call knows it."""
        found = parse_refusal(str(exc))
        if found is None:
            return False
        op, lowered = found
        taken = self._fail_requests(lowered) if op == "publish" else 0
        for wanted, caught in self._expected:
            for want_op, subject in wanted:
                if want_op == op and subject.lower() == lowered:
                    caught.append(self.error(op, subject))
                    taken += 1
        if taken:
            log.debug("refused and reported to the caller: %s %s", op, lowered)
        else:
            self._warn(op, lowered)
        return True

    def error(self, op: str, subject: str) -> NotPermitted:
        return NotPermitted(refusal_message(op, subject, self.who), op=op, subject=subject)

    def _fail_requests(self, lowered: str) -> int:
        prefix = (getattr(self.nc, "_resp_sub_prefix", None) or b"").decode()
        pending = getattr(self.nc, "_resp_map", None) or {}
        failed = 0
        for reply, subject in [(r, s) for r, s in self._sent.items() if s.lower() == lowered]:
            del self._sent[reply]
            future = pending.get(reply[len(prefix) :]) if prefix and reply.startswith(prefix) else None
            if future is not None and not future.done():
                future.set_exception(self.error("publish", subject))
                failed += 1
        return failed

    def _warn(self, op: str, subject: str) -> None:
        """A refusal nobody waits for (a plain publish): logged, once a minute per subject."""
        now = time.monotonic()
        if now - self._warned.get((op, subject), -_WARN_EVERY) >= _WARN_EVERY:
            self._warned[(op, subject)] = now
            if len(self._warned) > _RECENT:
                self._warned.clear()
            log.warning("%s", self.error(op, subject))

    @asynccontextmanager
    async def checked(self, op: str, subjects: Iterable[str], timeout: float = 5.0) -> AsyncIterator[None]:
        """Around subscribes (op "subscribe") or publishes (op "publish") to `subjects`: after the
        block, NotPermitted if the server refused any of them.

        The server does not send a refusal before the PONG of the round trip that follows it
        (nats-server 2.15 sent it after that PONG about once in five), so this waits for two."""
        entry: tuple[set[tuple[str, str]], list[NotPermitted]] = ({(op, s) for s in subjects}, [])
        self._expected.append(entry)
        try:
            yield
            for _ in range(2):
                await self.nc.flush(timeout=timeout)
        finally:
            self._expected.remove(entry)
        if entry[1]:
            raise entry[1][0]


def denials_of(nc: Any) -> Denials | None:
    """The connection's Denials; None for one jetllm did not open (`connection.connect`)."""
    return getattr(nc, "denials", None)


@asynccontextmanager
async def checked(nc: Any, op: str, *subjects: str) -> AsyncIterator[None]:
    """`Denials.checked` on `nc`, or nothing for a connection jetllm did not open."""
    denials = denials_of(nc)
    if denials is None:
        yield
        return
    async with denials.checked(op, subjects):
        yield
