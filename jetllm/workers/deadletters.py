"""The dead-letter stream of a worker's queue: a job that cannot or must not run again is recorded
there with its reason, once.

Each record is published under the id `dlq-<jobs stream>-<stream seq>`, so the copies that several
workers publish for the same job (every worker of a model hears JetStream's max-deliveries
advisory) and a retried publish collapse into one record.
"""

from __future__ import annotations

from ..schemas import DeadLetter
from ..subjects import codec
from .context import WorkerContext


class DeadLetters:
    def __init__(self, ctx: WorkerContext, queue: str) -> None:
        self._ctx = ctx
        self._subject = ctx.names.dlq(queue, ctx.model)

    async def publish(self, record: DeadLetter, stream_seq: int, *, part: str | None = None) -> None:
        """Store the record (acknowledged); raises if JetStream did not take it. `part`: which
        request of a job that carries several (a shard) the record is for."""
        names = self._ctx.names
        msg_id = f"dlq-{names.jobs_stream}-{stream_seq}" + (f"-{part}" if part else "")
        await self._ctx.js.publish(self._subject, codec.encode(record), headers={"Nats-Msg-Id": msg_id})
