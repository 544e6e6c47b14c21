"""One remote prefill, as a decode worker runs it: publish the prefill job, wait for the answer,
fetch and check the blocks into a block file the engine's connector loads.

Every failure (no answer in time, an error answer, blocks that are late, missing, corrupt or
expired) ends in `HandoffFailed` with the reason, and the caller computes the prompt itself;
the prefill job is cancelled on the way out unless it answered, so a prefill engine never keeps
computing for nobody.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats.errors

from ....aio import task_group
from ....kvtransfer import blockfile
from ....kvtransfer.params import JETLLM_CONNECTOR, LOAD
from ....kvtransfer.transport import Incoming, TransferFailed, fetch_blocks, remove_blocks
from ....kvtransfer.window import WINDOW_BYTES
from ....schemas import (
    AcceptedFrame,
    CancelRequest,
    ErrorFrame,
    HeartbeatFrame,
    Prefilled,
    PrefillRequest,
    PulledFrame,
    TokensPrompt,
)
from ....subjects import codec
from ...config import DisaggSettings
from ...context import WorkerContext
from .policy import PrefillQueue

PrefillAnswer = PulledFrame | AcceptedFrame | HeartbeatFrame | ErrorFrame | Prefilled
answer_decoder = codec.KindDecoder(PrefillAnswer)

PING_INTERVAL = 1.0
"""Seconds between pings of the prefill worker running a job (its death is seen within this)."""

QUEUE_INFO_TTL = 1.0
"""Seconds a read of the prefill consumer is reused: deciding must not cost a request per job."""


class HandoffFailed(Exception):
    def __init__(self, reason: str, label: str) -> None:
        super().__init__(reason)
        self.label = label
        """Metric label: `local_<label>` counts prompts that fell back for this kind of reason."""


class Handoff(msgspec.Struct, kw_only=True):
    done: Prefilled
    path: Path | None
    """The block file to load (jetllm's connector); None when vLLM's connectors moved the blocks."""
    fetch_ms: float
    source: str
    """"live" (received as published), "stored" (read back from the block stream), or the vLLM
    connector that moved the blocks."""

    def kv_transfer(self) -> dict[str, Any] | None:
        """What the decode engine's connector is told for this request."""
        if self.path is not None:
            return {LOAD: self.path.name}
        return self.done.kv_params


class RemotePrefill:
    """The decode side of the handoff, shared by every job of the worker."""

    def __init__(self, ctx: WorkerContext, settings: DisaggSettings, block_dir: Path) -> None:
        self._ctx = ctx
        self._s = settings
        self._dir = block_dir
        self._queue: PrefillQueue | None = None
        self._queue_at = 0.0

    async def queue(self) -> PrefillQueue | None:
        """The prefill consumer's state (None: there is none), re-read at most once a second."""
        now = time.monotonic()
        if now - self._queue_at < QUEUE_INFO_TTL:
            return self._queue
        self._queue_at = now
        names = self._ctx.names
        try:
            info = await self._ctx.js.consumer_info(
                names.jobs_stream, names.consumer("prefill", self._ctx.model)
            )
            self._queue = PrefillQueue(
                workers_waiting=info.num_waiting or 0,
                queued=info.num_pending or 0,
                running=info.num_ack_pending or 0,
            )
        except Exception:  # no consumer: no prefill worker ever served this model
            self._queue = None
        return self._queue

    async def run(self, request_id: str, attempt: int, prompt_ids: list[int]) -> Handoff:
        ctx, s = self._ctx, self._s
        transfer = uuid.uuid4().hex
        job = PrefillRequest(
            request_id=f"{request_id}:prefill:{attempt}",
            reply_to=ctx.nc.new_inbox(),
            model=ctx.model,
            prompt=TokensPrompt(token_ids=prompt_ids),
            transfer_id=transfer,
            expires_at=time.time() + s.prefill_timeout,
            packed=True,
            checksum=blockfile.preferred_checksum(),
            window=WINDOW_BYTES,
            stored=s.stored,
        )
        path = self._dir / f"{transfer}.kv"
        ours = s.connector == JETLLM_CONNECTOR
        sub = await ctx.nc.subscribe(job.reply_to)
        incoming = None
        if ours:
            incoming = await Incoming.open(
                ctx.nc,
                ctx.names,
                transfer,
                max_bytes=s.kv_store_bytes,
                dest=path,
                window=job.window,
                stored=job.stored,
            )
        answered = False
        try:
            try:
                await ctx.js.publish(
                    ctx.names.jobs("prefill", ctx.model),
                    codec.encode(job),
                    headers={"Nats-Msg-Id": f"{job.request_id}:{transfer}"},
                    timeout=5,
                )
            except (nats.errors.Error, TimeoutError) as exc:
                raise HandoffFailed(f"the prefill job was not queued: {exc}", "fallback_queue") from None
            done = await self._answer(sub, job)
            answered = True
            if done.connector != s.connector:
                if done.connector == JETLLM_CONNECTOR and job.stored:
                    await self._remove(transfer)
                raise HandoffFailed(
                    f"{done.worker} moved the blocks with the {done.connector} KV connector; this "
                    f"worker's engine loads with {s.connector} (give both roles the same --kv-connector)",
                    "fallback_connector",
                )
            if not ours:
                return Handoff(done=done, path=None, fetch_ms=0.0, source=done.connector)
            started = time.monotonic()
            try:
                source = await fetch_blocks(
                    ctx.nc,
                    ctx.names,
                    done,
                    path,
                    timeout=s.transfer_timeout,
                    incoming=incoming,
                    stored=job.stored,
                )
            except TransferFailed as exc:
                raise HandoffFailed(
                    f"the blocks from {done.worker} are unusable: {exc}", "fallback_transfer"
                ) from None
            finally:
                if job.stored:
                    await self._remove(transfer)
            return Handoff(done=done, path=path, fetch_ms=(time.monotonic() - started) * 1000, source=source)
        finally:
            with anyio.CancelScope(shield=True):
                if incoming is not None:
                    await incoming.close()
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass
                if not answered:
                    await self._cancel(job.request_id)

    async def _remove(self, transfer: str) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await remove_blocks(self._ctx.nc, self._ctx.names, transfer)
            except Exception:  # the stream's TTL removes them
                pass

    async def _answer(self, sub: object, job: PrefillRequest) -> Prefilled:
        """The prefill worker's answer; fails on an error answer, on silence past the timeout, and
        as soon as a worker that pulled or accepted the job stops answering pings (it died)."""
        got: list[Prefilled] = []
        failed: list[HandoffFailed] = []
        watched: set[str] = set()
        try:
            with anyio.fail_after(self._s.prefill_timeout):
                async with task_group() as tg:

                    async def read() -> None:
                        async for msg in sub.messages:  # type: ignore[attr-defined]
                            try:
                                answer = answer_decoder.decode(msg.data)
                            except (msgspec.DecodeError, msgspec.ValidationError):
                                continue  # a newer prefill worker's frame kind, or garbage
                            if isinstance(answer, (PulledFrame, AcceptedFrame)):
                                if answer.worker not in watched:  # one watch per worker, however many frames
                                    watched.add(answer.worker)
                                    tg.start_soon(self._watch, answer.worker, failed, tg.cancel_scope)
                            elif isinstance(answer, ErrorFrame):
                                failed.append(
                                    HandoffFailed(
                                        f"the prefill worker failed it: {answer.code.value}: {answer.message}",
                                        "fallback_error",
                                    )
                                )
                                break
                            elif isinstance(answer, Prefilled) and answer.transfer_id == job.transfer_id:
                                got.append(answer)
                                break
                        tg.cancel_scope.cancel()

                    tg.start_soon(read)
        except TimeoutError:
            raise HandoffFailed(
                f"no prefill answer within {self._s.prefill_timeout:.0f}s", "fallback_timeout"
            ) from None
        if got:
            return got[0]
        raise failed[0]

    async def _watch(self, worker: str, failed: list[HandoffFailed], scope: anyio.CancelScope) -> None:
        """Ping the prefill worker running the job: the server answers "no responders" at once
        when its connection is gone, long before any timeout."""
        subject = self._ctx.names.instance_control(worker, "ping")
        while True:
            await anyio.sleep(PING_INTERVAL)
            try:
                await self._ctx.nc.request(subject, b"", timeout=PING_INTERVAL)
            except nats.errors.NoRespondersError:
                failed.append(HandoffFailed(f"the prefill worker {worker} died", "fallback_died"))
                scope.cancel()
                return
            except Exception:  # slow to answer is not dead: the timeout covers a stuck worker
                pass

    async def _cancel(self, request_id: str) -> None:
        try:
            await self._ctx.nc.publish(
                self._ctx.names.cancel(request_id),
                codec.encode(
                    CancelRequest(request_id=request_id, reason="its decode worker stopped waiting")
                ),
            )
        except Exception:  # the prefill job expires anyway
            pass
