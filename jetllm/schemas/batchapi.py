"""The OpenAI-style batch API's state in NATS: a file's metadata, a batch's state, a batch to run.

A batch's state lives in the `<NS>_BATCHES` bucket under `b.<batch>`, so any gateway replica
answers for any batch; the runner that holds the batch and the gateways that cancel it change it
by compare-and-set on the entry's revision.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from .common import Command, Report, Tolerant

BATCH_STATUSES = (
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "cancelling",
    "cancelled",
    "expired",
)
"""OpenAI's status values, in the order a batch may pass through them."""

TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled", "expired"})


class FileMeta(Report, kw_only=True):
    """Kept as the JSON `description` of a file's object in the `<NS>_FILES` object store (the
    object's name is the file id)."""

    filename: str
    purpose: str
    """`batch` (an input someone uploaded), `batch_output` (written by a batch runner)."""
    created_at: int
    """Unix seconds."""
    bytes: int


class RequestCounts(Tolerant, kw_only=True):
    total: int = 0
    completed: int = 0
    """Lines whose request returned a response (status 200)."""
    failed: int = 0
    """Lines that got an error (in the error file)."""


class BatchIssue(Tolerant, kw_only=True):
    """Why a batch failed as a whole (OpenAI's `errors.data` entries)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None
    """1-based line of the input file, when one line is at fault."""


class BatchState(Report, kw_only=True):
    """One batch, as the API shows it (OpenAI's Batch object, minus `object`)."""

    id: str
    endpoint: str
    """`/v1/chat/completions` or `/v1/completions`: what every line of the input asks for."""
    input_file_id: str
    completion_window: str
    """`24h` or any `<n>h`: after this long the batch stops and its unfinished lines expire."""
    status: str
    """One of BATCH_STATUSES; readers treat a status they do not know as in progress."""
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    errors: list[BatchIssue] = []
    runner: str | None = None
    """Instance id of the runner that last took the batch (not part of OpenAI's object)."""


class BatchRun(Command, kw_only=True):
    """Published to `jetllm.<ns>.batchq.<batch>` (dedupe id: the batch id) when a batch is created;
    one batch runner holds it (in-progress acks) until the batch ends, and acks it then."""

    batch_id: Annotated[str, Meta(pattern=r"^batch_[0-9a-f]{8,64}$")]
