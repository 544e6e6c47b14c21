"""How many more jobs the server may still send a puller, across all its pull requests; and how
long to wait before pulling again while the server refuses pulls.

A job JetStream delivers carries its own subject, not the reply token of the pull request that
brought it, and the server serves a consumer's waiting requests round-robin (a request with credit
left goes to the back of the queue after each delivery). So a delivery cannot be charged to its own
request, but every delivery takes exactly one credit from the total. The total is kept exact:
+batch per request, -1 per delivery, and when a status ends a request (408 expiry, 409 refusal) its
`Nats-Pending-Messages` header says what that request still had.

Where a request's own credit is needed (a status without that header, or a request the server never
closed), deliveries count as taken from the oldest requests first: its share is the total filled into
the newest requests first, up to their batch. Dropping that share never takes the total below the
true credit: a request refused on arrival (409 without the header) still had its whole batch, and by
a request's deadline the older ones are gone, so one the server used up silently has a share of 0.
At worst the total stays too high for a while: fewer pulls, never a job without a slot.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    batch: int
    deadline: float


class PullCredit:
    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}  # oldest first
        self.total = 0

    def requested(self, token: str, batch: int, deadline: float) -> None:
        """A pull request was sent; `deadline` is when to forget it if the server never closes it."""
        self._requests[token] = _Request(batch, deadline)
        self.total += batch

    def delivered(self) -> None:
        """A job arrived (with no credit left, a forgotten request was honoured: nothing to take)."""
        self.total = max(self.total - 1, 0)

    def ended(self, token: str, pending: int | None) -> None:
        """A status closed the request; `pending` is its Nats-Pending-Messages header, if it had one."""
        if token not in self._requests:
            return  # forgotten already, or not ours
        left = self.share(token) if pending is None else pending
        self._drop(token, left)

    def expire(self, now: float) -> None:
        """Forget requests past their deadline (their status was lost, e.g. in a reconnect)."""
        for token in [t for t, r in self._requests.items() if r.deadline < now]:
            self._drop(token, self.share(token))

    def clear(self) -> None:
        """The server has dropped every request (their inbox was closed)."""
        self._requests.clear()
        self.total = 0

    def share(self, token: str) -> int:
        """The credit charged to one request: the total, filled into the newest requests first."""
        newer = 0
        for t in reversed(self._requests):
            batch = self._requests[t].batch
            if t == token:
                return min(max(self.total - newer, 0), batch)
            newer += batch
        return 0

    def _drop(self, token: str, left: int) -> None:
        request = self._requests.pop(token)
        self.total -= min(max(left, 0), request.batch)
        # The others can hold no more than their batches (all the more so once none is left).
        self.total = max(min(self.total, sum(r.batch for r in self._requests.values())), 0)


class Refusals:
    """Backing off while the server refuses pulls (a deleted consumer refuses every one at once):
    without it the puller would spin on refusals and fill the log."""

    FIRST = 0.1
    LONGEST = 5.0

    def __init__(self) -> None:
        self.delay = 0.0
        self.retry_at = 0.0

    def refused(self, now: float, why: str) -> None:
        if self.delay == 0.0:
            log.warning("pull request refused: %s", why)
        else:
            log.debug("pull request refused again: %s", why)
        self.delay = min(self.delay * 2, self.LONGEST) if self.delay else self.FIRST
        self.retry_at = now + self.delay

    def answered(self) -> None:
        if self.delay:
            log.info("pull requests accepted again")
        self.delay = 0.0
        self.retry_at = 0.0

    def wait_left(self, now: float) -> float:
        return self.retry_at - now
