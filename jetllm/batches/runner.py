"""The batch runner: takes batches from the batch queue and drains them through the fleet.

A batch is one durable message, held by one runner (in-progress acks) until the batch ends. The
runner turns lines into detached generate jobs, with request ids derived from (batch, line): at
most `window` of them wait in the queue at once, and as workers take them, more follow, so a batch
fills every free slot of the fleet while an online request waits behind at most `window` of its
jobs (plus, for `plan.REFILL_SECONDS`, one for each slot seen free: the registry's as the batch
starts, a finished line's later). The request log keeps every line's result. A runner that dies leaves the message un-acked:
after ack_wait another runner takes it, reads the lines that finished from the request log, and
submits the rest again under the same ids (a job still queued is dropped as a duplicate, one that
ran is not run again).
"""

from __future__ import annotations

import logging
import uuid
from typing import Protocol

import anyio
import nats.errors
from nats.aio.msg import Msg

from .. import aio
from ..producer import Client
from ..schemas import BatchRun
from ..subjects import codec
from . import plan
from .held import HeldBatch
from .service import BatchService

log = logging.getLogger(__name__)
_run_decoder = codec.Decoder(BatchRun)


class RunnerSettings(Protocol):
    """What configures a runner: `jetllm batch-runner`'s flags, or a gateway's BatchSettings."""

    @property
    def window(self) -> int: ...
    @property
    def most(self) -> int: ...
    @property
    def refill(self) -> float: ...
    @property
    def shard(self) -> int: ...
    @property
    def batches(self) -> int: ...
    @property
    def ack_wait(self) -> float | None: ...


class BatchRunner:
    @classmethod
    def configured(cls, client: Client, service: BatchService, settings: RunnerSettings) -> BatchRunner:
        return cls(
            client,
            service,
            window=settings.window,
            most=settings.most,
            refill=settings.refill,
            shard=settings.shard,
            batches=settings.batches,
            ack_wait=settings.ack_wait,
        )

    def __init__(
        self,
        client: Client,
        service: BatchService,
        *,
        window: int = plan.DEFAULT_WINDOW,
        most: int = plan.MAX_IN_FLIGHT,
        refill: float = plan.REFILL_SECONDS,
        shard: int = plan.SHARD_LINES,
        batches: int = 2,
        ack_wait: float | None = None,
        instance: str | None = None,
    ) -> None:
        self.client = client
        self.service = service
        self.pacing = plan.Pacing(
            window=max(1, window), most=max(1, most), refill=max(0.0, refill), shard=max(0, shard)
        )
        self.batches = max(1, batches)
        self.ack_wait = ack_wait or plan.DEFAULT_ACK_WAIT
        """The consumer's ack_wait as last read (`_consumer_ack_wait`); this until it is read."""
        self.instance = instance or f"runner-{uuid.uuid4().hex[:12]}"

    async def serve(self) -> None:
        """Take batches until cancelled, `batches` at a time."""
        names = self.service.names
        sub = await self.client.js.pull_subscribe_bind(
            durable=names.BATCH_RUNNERS, stream=names.batch_queue_stream
        )
        free = anyio.Semaphore(self.batches)
        try:
            async with aio.task_group() as tg:
                while True:
                    await free.acquire()
                    try:
                        msgs = await sub.fetch(1, timeout=2.0)
                    except (nats.errors.TimeoutError, TimeoutError):  # nothing queued
                        free.release()
                        continue
                    except Exception as exc:  # the server is away for now: no busy loop meanwhile
                        free.release()
                        log.info("batch queue: %s; trying again in 1 s", aio.describe(exc))
                        await anyio.sleep(1.0)
                        continue
                    tg.start_soon(self._hold, msgs[0], free)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass

    async def _hold(self, msg: Msg, free: anyio.Semaphore) -> None:
        try:
            try:
                batch_id = _run_decoder.decode(msg.data).batch_id
            except Exception as exc:  # nobody can run it; no message from outside stops the runner
                log.warning("dropping an unreadable batch message: %s", exc)
                try:
                    await msg.term()
                except Exception as term_exc:  # it comes back after ack_wait and is dropped then
                    log.warning("could not drop the unreadable batch message: %s", term_exc)
                return
            failed = False
            async with aio.task_group() as tg:
                tg.start_soon(self._keep_alive, msg)
                try:
                    await HeldBatch(self.client, self.service, self.pacing, self.instance, batch_id).run()
                except Exception:
                    log.exception("batch %s: runner failed; the batch goes back to the queue", batch_id)
                    failed = True
                tg.cancel_scope.cancel()
            try:
                await (msg.nak(delay=5) if failed else msg.ack())
            except Exception as exc:  # then it comes back after ack_wait, and is skipped if it ended
                log.warning(
                    "batch %s: could not %s its message: %s", batch_id, "nak" if failed else "ack", exc
                )
        finally:
            free.release()

    async def _keep_alive(self, msg: Msg) -> None:
        """Every third of the consumer's ack_wait, read again each time: the consumer's, not this
        runner's flag, says when the batch goes to another runner, and a runner started later with
        another --batch-ack-wait changes it for all."""
        while True:
            await anyio.sleep(await self._consumer_ack_wait() / 3)
            try:
                await msg.in_progress()
            except Exception as exc:  # the next one may pass; after ack_wait the batch moves on
                log.warning("could not extend the batch message: %s", exc)

    async def _consumer_ack_wait(self) -> float:
        names = self.service.names
        try:
            info = await self.client.js.consumer_info(names.batch_queue_stream, names.BATCH_RUNNERS)
            if info.config.ack_wait:
                self.ack_wait = float(info.config.ack_wait)
        except Exception as exc:  # the last one read (or the flag's) until it can be read again
            log.info(
                "could not read the batch consumer's ack_wait (%s); extending every %.1fs",
                exc,
                self.ack_wait / 3,
            )
        return self.ack_wait
