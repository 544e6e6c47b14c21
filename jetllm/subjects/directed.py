"""Directed jobs: the pure decisions of where one goes and when it must move.

A directed job waits on its instance's own subject (`Names.directed_jobs`), pulled only by that
instance. It must never be stranded there, so three rules, all plain functions here:

- publishing: a job addressed to an instance that is not alive and serving its model goes to the
  shared queue at once (`placement`);
- sweeping: the directed jobs of an instance that is gone (no live registry record, or its
  connection is gone) are moved to the shared queue by any worker that notices (`sweep_verdict`);
- moving: a moved job is republished with the message id `moved_msg_id`, made from the directed
  message's stream sequence, so two movers of the same job publish one job (JetStream drops the
  second copy within the duplicate window) and a moved job is never mistaken for its original,
  whose request id JetStream already holds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from ..schemas import InstanceRecord
from .names import Names

MSG_ID = "Nats-Msg-Id"
DIRECTED_TO = "Jetllm-Directed-To"
"""Header of a moved job: the instance it was addressed to (the trace says so)."""


def record_alive(record: InstanceRecord, now: float | None = None) -> bool:
    """Whether a registry record still counts: heartbeat no older than its `expires_after`."""
    now = time.time() if now is None else now
    return record.expires_after <= 0 or now - record.heartbeat_at <= record.expires_after


def placement(record: InstanceRecord | None, queue: str, model: str, now: float) -> str | None:
    """Why a job of `queue` for `model` addressed to the instance of `record` goes to the shared
    queue instead; None: publish it directed."""
    if record is None:
        return "not in the registry"
    if not record_alive(record, now):
        return "its registry record expired"
    if record.directed_queue != queue:
        return f"it pulls no directed {queue} jobs"
    if record.model != model:
        return f"it serves {record.model!r}, not {model!r}"
    if record.state != "serving":
        return f"it is {record.state}"
    return None


def sweep_verdict(instance: str, me: str, record: InstanceRecord | None, now: float) -> str:
    """What the sweeper `me` does with the directed jobs waiting for `instance`: `skip` its own (a
    live worker hands its own on when it stops), `move` those of an instance without a live
    record, and `ping` one whose record is live (its connection may be gone all the same: moved
    when nobody answers)."""
    if instance == me:
        return "skip"
    if record is None or not record_alive(record, now):
        return "move"
    return "ping"


def moved_msg_id(original: str | None, seq: int) -> str:
    """The dedupe id of a directed job moved to the shared queue: the same for every mover of the
    message at stream sequence `seq`, and never the original's (a request id, already seen)."""
    return f"{original or 'job'}~moved~{seq}"


def moved_headers(headers: Mapping[str, str] | None, seq: int, instance: str) -> dict[str, str]:
    """The headers of the moved copy: the job's own (content type, traceparent, frame batch
    subject), a new message id, and the instance it was addressed to."""
    kept = {k: v for k, v in (headers or {}).items() if not k.startswith("Nats-")}
    kept[MSG_ID] = moved_msg_id((headers or {}).get(MSG_ID), seq)
    kept[DIRECTED_TO] = instance
    return kept


def queue_of(names: Names, subject: str, headers: Mapping[str, str] | None) -> str:
    """How a job reached the worker, for its trace: `directed`, `moved from <instance>` (a directed
    job handed on to the shared queue) or `shared`."""
    if names.parse_directed(subject) is not None:
        return "directed"
    origin = (headers or {}).get(DIRECTED_TO)  # any producer can set it: kept short
    return f"moved from {origin[:128]}" if origin else "shared"
