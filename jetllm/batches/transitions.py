"""How a runner changes a batch's state, as plain functions of the state it reads (tested as
tables). Each returns the new state, or None where the change no longer applies because a cancel,
an end or another runner came first: `BatchService.update` applies them by compare-and-set, again
on the newest state when someone wrote in between."""

from __future__ import annotations

import msgspec

from ..schemas import TERMINAL_STATUSES, BatchIssue, BatchState, RequestCounts, Result
from . import plan


def counts(total: int, outcomes: dict[int, Result]) -> RequestCounts:
    ok = sum(1 for r in outcomes.values() if r.final is not None)
    return RequestCounts(total=total, completed=ok, failed=len(outcomes) - ok)


def started(state: BatchState, *, runner: str, counts: RequestCounts, now: int) -> BatchState | None:
    """Taken by `runner`; a resumed batch keeps when it first went in progress."""
    if state.status not in ("validating", "in_progress"):
        return None
    return msgspec.structs.replace(
        state,
        status="in_progress",
        in_progress_at=state.in_progress_at or now,
        runner=runner,
        request_counts=counts,
    )


def counted(state: BatchState, *, counts: RequestCounts) -> BatchState | None:
    if state.status != "in_progress":
        return None
    return msgspec.structs.replace(state, request_counts=counts)


def failed(
    state: BatchState, *, issue: BatchIssue, counts: RequestCounts | None, now: int
) -> BatchState | None:
    """The batch as a whole cannot run; `counts` None keeps those it has."""
    if state.status in TERMINAL_STATUSES:
        return None
    kept = counts or state.request_counts
    return msgspec.structs.replace(state, status="failed", failed_at=now, errors=[issue], request_counts=kept)


def finalizing(state: BatchState, *, now: int) -> BatchState | None:
    """Every line ended: its output files are being written (a cancel that came first wins)."""
    if state.status != "in_progress":
        return None
    return msgspec.structs.replace(state, status="finalizing", finalizing_at=now)


def ended(
    state: BatchState,
    *,
    stop: plan.Stop,
    output_file_id: str | None,
    error_file_id: str | None,
    counts: RequestCounts,
    now: int,
) -> BatchState | None:
    """The batch's end, by why it stopped; a batch being cancelled ends cancelled whatever its
    runner saw, since the cancel is what the user asked for last."""
    if state.status in TERMINAL_STATUSES:
        return None
    status = plan.FINAL_STATUS[stop] if state.status != "cancelling" else "cancelled"
    return msgspec.structs.replace(
        state,
        status=status,
        output_file_id=output_file_id,
        error_file_id=error_file_id,
        request_counts=counts,
        **{f"{status}_at": now},
    )
