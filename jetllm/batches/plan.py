"""The batch runner's decisions, as plain functions of what it knows (tested as tables)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from ..cutting import consecutive
from ..schemas import TERMINAL_STATUSES, InstanceRecord
from ..subjects.setup import DEFAULT_BATCH_ACK_WAIT

T = TypeVar("T")

DEFAULT_WINDOW = 32
"""Jobs of one batch waiting in the queue at once (running ones do not count). An online request
arriving behind a batch waits for at most this many of its jobs (and those REFILL_SECONDS lets
through), however long the batch, while the batch takes every slot the fleet has free."""
REFILL_SECONDS = 0.5
"""A slot seen free (by the registry as a batch starts, or left by a line that ran and ended) lets
one job of the batch into the queue beyond the window for this long: a fleet is filled at once
instead of `window` jobs per round trip to a worker's claim, and an online request waits at most
about this much longer."""
MAX_IN_FLIGHT = 4096
"""Lines of one batch a runner follows at once (a subscription each), queued or running, unless
told fewer (`--batch-max-lines`): more than most fleets have slots for, so the fleet, not the
runner, bounds what runs. Fewer leaves the rest of the fleet to online traffic."""
DEFAULT_ACK_WAIT = DEFAULT_BATCH_ACK_WAIT
"""Seconds a batch stays with a runner that gave no sign of life before another runner takes it,
in a namespace whose runners' consumer was made without `--batch-ack-wait`."""
MAX_WINDOW_SECONDS = 7 * 24 * 3600
SHARD_LINES = 64
"""Lines of one model that travel together as one shard job (schemas/shard.py), when the model's
workers take shards: one message and one ack for all of them, and per line its claim and result,
where a line as a job of its own costs about fifteen messages (docs/decisions.md, "A batch's lines
travel in shards")."""
RESULT_RECHECK = 60.0
"""Seconds between direct reads of a running line's result while nothing says its live record was
missed: the safety net for a record the server dropped on a slow runner."""


@dataclass(frozen=True, slots=True)
class Pacing:
    """How a runner feeds a batch's lines to the fleet: `window` jobs queued at most, `most` lines
    followed at once, a slot seen free lets one more in for `refill` seconds (see the constants)."""

    window: int = DEFAULT_WINDOW
    most: int = MAX_IN_FLIGHT
    refill: float = REFILL_SECONDS
    shard: int = SHARD_LINES
    """At most this many lines to a shard; 1 (or 0): every line a job of its own."""


_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([hms])$")

Action = Literal["skip", "run", "cancel", "expire"]
Stop = Literal["done", "cancel", "expire"]


def parse_window(text: str) -> int:
    """Seconds of a completion window: OpenAI's `24h`, or any `<n>h`, `<n>m`, `<n>s` up to 7 days."""
    m = _WINDOW.match(text or "")
    seconds = int(m.group(1)) * {"h": 3600, "m": 60, "s": 1}[m.group(2)] if m else 0
    if not m or seconds > MAX_WINDOW_SECONDS:
        raise ValueError(
            f"completion_window must look like '24h' (at most {MAX_WINDOW_SECONDS // 3600}h), got {text!r}"
        )
    return seconds


def on_take(status: str, now: float, expires_at: float) -> Action:
    """What a runner does with a batch it was handed (first time, or after its runner died)."""
    if status in TERMINAL_STATUSES:
        return "skip"
    if status == "cancelling":
        return "cancel"
    if now >= expires_at and status != "finalizing":
        return "expire"
    return "run"


def stop_reason(status: str, now: float, expires_at: float) -> Stop | None:
    """Checked while lines run: why to stop submitting, if at all."""
    if status == "cancelling":
        return "cancel"
    if now >= expires_at:
        return "expire"
    return None


def to_submit(
    pending: int, queued: int, in_flight: int, window: int, most: int = MAX_IN_FLIGHT, freed: int = 0
) -> int:
    """How many more lines to submit now: the window bounds the batch's jobs no worker has taken
    yet (`queued`), widened by the slots seen free within REFILL_SECONDS that no job was submitted
    for yet (`freed`); `most` bounds those it follows at all (`in_flight`, queued or running)."""
    return max(0, min(pending, window + freed - queued, most - in_flight))


def free_slots(records: Iterable[InstanceRecord], models: set[str]) -> int:
    """Slots free now, as the registry has it, on live workers that serve one of `models` (as the
    base model or an adapter) and take generate jobs."""
    return sum(
        max(0, r.slots - r.in_flight)
        for r in records
        if r.state == "serving"
        and r.ready
        and r.role != "prefill"
        and (r.model in models or models & set(r.adapters))
    )


def shard_sizes(records: Iterable[InstanceRecord], most: int) -> dict[str, int]:
    """For each base model whose live workers take shards, the most lines to put in one: `most`,
    and no more than any of them asks (`InstanceRecord.shard_lines`, also the most a worker holds
    beyond its slots). A model with a worker that takes none (an older version, or too few slots),
    or whose shards would hold one line, is left out: its lines go singly."""
    sizes: dict[str, int] = {}
    for r in records:
        if r.state == "serving" and r.ready and r.role != "prefill":
            sizes[r.model] = min(sizes.get(r.model, most), r.shard_lines)
    return {model: size for model, size in sizes.items() if size > 1}


def shards(members: Sequence[T], most: int, max_bytes: int, size: Callable[[T], int]) -> list[list[T]]:
    """`members` in order, cut into shards of at most `most` members and `max_bytes` of their
    `size` together (a member larger than that alone is a shard of its own)."""
    return consecutive(members, [size(m) for m in members], max_bytes, most)


def widened_by(queued: int, submitted: int, window: int) -> int:
    """How many of `submitted` new jobs went beyond the window: each spends one freed slot."""
    return max(0, queued + submitted - window) - max(0, queued - window)


FINAL_STATUS: dict[Stop, str] = {"done": "completed", "cancel": "cancelled", "expire": "expired"}
UNRUN_CODE: dict[Stop, str] = {"done": "batch_failed", "cancel": "batch_cancelled", "expire": "batch_expired"}
"""The error of a line that never got a response, by why the batch stopped."""


def page(items: Sequence[T], after: str | None, limit: int, key: Callable[[T], str]) -> tuple[list[T], bool]:
    """The `limit` items after the one whose key is `after` (from the start when None or unknown),
    and whether more follow."""
    limit = max(1, min(limit, 100))
    start = 0
    if after is not None:
        for i, item in enumerate(items):
            if key(item) == after:
                start = i + 1
                break
    chosen = list(items[start : start + limit])
    return chosen, start + limit < len(items)


def read_result(*, duplicate: bool, reconnected: bool, since_read: float) -> bool:
    """Whether a line still waiting reads its result from the request log rather than waiting for
    it on the log's subject (subscribed to before its job was submitted): a duplicate submit means
    an earlier runner's job, which may have ended before the subscription; across a reconnect a
    record may have gone by; otherwise every RESULT_RECHECK seconds. Until 2026-11-29 every line
    read every 5 s: a batch of 512-token lines made more direct reads than it ran lines."""
    return duplicate or reconnected or since_read >= RESULT_RECHECK
