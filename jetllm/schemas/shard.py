"""A shard: many detached generate requests of one batch as one job.

A batch line as a job of its own costs the plane about fifteen messages (the job and its PubAck,
the pulled frame, two log reads, the claim, the result and its PubAck, the ack and its
confirmation, a trace record, ...), which on a small box is CPU the engine wants. A shard carries
up to a few hundred lines: one message, one ack, and per line only its claim and its stored result,
so every reader of a line's log (the runner, the gateway, `Client.result`) finds it as before.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from .common import Command
from .generate import GenerateRequest, RequestId

MAX_SHARD_REQUESTS = 1024
"""The most requests one shard may carry."""


class ShardJob(Command, kw_only=True):
    """Published to `jetllm.<ns>.jobs.shard.<model>`, pulled by generate workers of the model with a
    free slot and no shard's requests beyond their slots (docs/decisions.md, "A batch's lines travel
    in shards").

    A shard that does not decode (a request of it among them) fails as a whole: each request it
    names gets the error as its result. A request that decodes but cannot be a line (it names
    another model, or a reply subject) fails alone, and the others run."""

    request_id: RequestId
    """The shard's own id (its `Nats-Msg-Id`); its lines keep theirs."""
    model: Annotated[str, Meta(min_length=1, max_length=256)]
    """The served base model every request names (no adapter: those go to their own queues)."""
    requests: Annotated[list[GenerateRequest], Meta(min_length=1, max_length=MAX_SHARD_REQUESTS)]
    """Detached generate requests (`reply_to` unset), each with a request id of its own."""
    fresh: bool = False
    """The submitter says no request of the shard ran before (a batch started afresh): on the
    shard's first delivery, unless the shard itself was cancelled, a worker claims each request
    with a write the server refuses when its log is not empty, instead of reading the log and its
    durable cancel first, and reads them only when refused. A request cancelled alone is then not
    seen cancelled before it starts: cancel the shard (its `request_id`)."""
    group: RequestId | None = None
    """What the shard is part of (a batch runner gives its batch's request-id prefix): a durable
    cancel of this id cancels the shard as a cancel of its own `request_id` does, so a batch stopped
    by any runner also stops the shards an earlier runner queued."""
    reply_to: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    """Unused: a shard answers through its requests' logs (kept because every job names one)."""
