"""The producer side: submit jobs and read their frames.

    async with Client(url) as c:
        async for frame in c.generate(req):
            ...
        result = await c.complete(req)

Frames land in one wildcard subscription (inboxes.py); the order of a request's frames, its
gaps and its worker's death are decided by the sequencer (sequencer.py); this module carries out
what they decide.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import PubAck

from .. import tracecontext
from ..aio import TaskGroup, describe, retried, task_group
from ..errors import JetStreamUnavailable, PayloadTooLarge, RequestFailed
from ..schemas import (
    Cancelled,
    CancelRequest,
    Delivered,
    EmbedsPrompt,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    Frame,
    GenerateRequest,
    Result,
    ShardJob,
)
from ..subjects import codec
from ..subjects.codec import HEADER_MARGIN
from ..subjects.connection import connect
from ..subjects.direct import subscribe_direct
from ..subjects.names import SHARD_QUEUE, Names, check_role, frame_batch_subject
from ..subjects.policy import QueuePolicy
from ..subjects.server import check_server
from ..subjects.setup import ensure_routing_stream, ensure_streams
from . import results
from .addressing import Addressing
from .completion import Completion, assemble
from .embeds import embeds_store, upload
from .inboxes import Inboxes
from .pings import Pings
from .sequencer import Decision, Sequencer

if TYPE_CHECKING:
    from ..router import Router

log = logging.getLogger(__name__)

_MAYBE_STORED = (nats.errors.TimeoutError, nats.errors.ConnectionClosedError)
_PUBLISH_RETRIED = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
)
"""What a publish meets while the server restarts or a stream's leader moves (while a cluster
elects a new leader, nothing answers on the stream's subjects: "no response from stream")."""


class Client:
    """A connection to one jetllm namespace, for producers."""

    def __init__(
        self,
        url: str | None = None,
        *,
        namespace: str = "default",
        nc: NATS | None = None,
        heartbeat_timeout: float = 2.0,
        probe_after: float = 0.25,
        migrate: bool = True,
        publish_timeout: float = 30.0,
        encoding: codec.Encoding = "msgpack",
        policy: QueuePolicy | None = None,
        name: str = "jetllm-producer",
        embeds_inline_max: int | None = None,
        router: Router | None = None,
        via_routers: bool = False,
    ) -> None:
        self.names = Names(namespace)
        self._url = url
        self._nc = nc
        self._own_nc = nc is None
        self._name = name
        self.heartbeat_timeout = heartbeat_timeout
        """Silence after which the request log is read in case the request ended while its last frames
        were lost; with `migrate` off, silence after which the request fails with WorkerSilent."""
        self.probe_after = probe_after
        """Silence after which the worker is pinged (and again as often while it lasts). Only "no
        responders", which the server answers once the worker's connection is gone, moves the job on:
        a slow worker is never taken for a dead one, so a short silence is enough."""
        self.migrate = migrate
        self.publish_timeout = publish_timeout
        self.encoding = encoding
        self._policy = policy or QueuePolicy()
        self.embeds_inline_max = embeds_inline_max
        """Embeddings bigger than this (bytes) go through the object store; None: whatever does not
        fit one message (max_payload)."""
        self._addressing = Addressing(self.names, router, via_routers)
        self.router = router
        """Places each job before it is published (started with the client unless already running)."""
        self.via_routers = via_routers
        """Publish jobs to the routing queue, for the `jetllm router` fleet to place."""
        self._own_router = False
        self._inboxes = Inboxes("")
        self._sub: Subscription | None = None
        self._pings: Pings | None = None
        self._tg: TaskGroup | None = None

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise RuntimeError("Client is not connected; use `async with Client(...)`")
        return self._nc

    async def __aenter__(self) -> Client:
        if self._nc is None:
            self._nc = await connect(self._url, name=self._name)
        try:
            await check_server(self._nc)
            self.js = self._nc.jetstream(timeout=10)
            await ensure_streams(self.js, self.names, self._policy)
            if self.via_routers:
                await ensure_routing_stream(self.js, self.names, self._policy)
            if self.router is not None and not self.router.started:
                await self.router.start(self._nc, self.names)
                self._own_router = True
            self._inboxes = Inboxes(self._nc.new_inbox())  # under the identity's inbox prefix
            self._sub = await subscribe_direct(self._nc, f"{self._inboxes.root}.*", self._inboxes.on_message)
            self._tg = task_group()
            await self._tg.__aenter__()
            self._tg.start_soon(self._inboxes.watch)
            self._pings = Pings(
                self._nc, lambda w: self.names.instance_control(w, "ping"), self._tg.start_soon
            )
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_router and self.router is not None:
            await self.router.close()
            self._own_router = False
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            self._tg = None
            self._pings = None
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
            self._sub = None
        if self._own_nc and self._nc is not None and not self._nc.is_closed:
            try:
                await self._nc.drain()
            except Exception as exc:  # e.g. the server restarting: every answer is in by now
                log.warning("closing the NATS connection: %s", describe(exc))
                await self._nc.close()
        self._nc = None

    # submitting

    def encode_job(self, req: GenerateRequest | ShardJob) -> bytes:
        data = codec.encode(req, self.encoding)
        limit = self.nc.max_payload - HEADER_MARGIN
        if len(data) > limit:
            raise PayloadTooLarge(
                f"job {req.request_id} is {len(data)} bytes; the NATS server accepts at most "
                f"{self.nc.max_payload} (max_payload) including ~{HEADER_MARGIN} bytes of headers"
            )
        return data

    async def submit(
        self,
        req: GenerateRequest,
        *,
        role: str = "generate",
        traceparent: str | None = None,
        batch_frames: bool = False,
        instance: str | None = None,
    ) -> PubAck:
        """Publish a job durably; the PubAck says it is stored, or was a duplicate: a job with this
        request id was stored before this call (not by an attempt of this call whose PubAck was lost).

        Retried across reconnects and JetStream leader changes for up to `publish_timeout`
        seconds; the request id as `Nats-Msg-Id` makes the retries safe. The job carries a W3C
        `traceparent` (the one given, else a new trace) that its frames and records repeat.
        `role` names the job queue, one of `names.ROLES` (the queues workers consume); any other
        raises ValueError rather than publish a job nobody would take. `batch_frames`: the reader of
        `req.reply_to` also reads its `.batch` sibling (as `generate` does), so the worker may send
        frames of several requests together. `instance`: address the job to that worker instance
        (a router's choice); it goes to the shared queue instead when the instance is not alive
        and serving `req.model` now, and is moved there if the instance dies before taking it. With a
        `router`, a job given no `instance` goes to the instance the router chooses (or the shared
        queue); with `via_routers`, to the routing queue.
        """
        check_role(role)
        req, _ = await self.offload_embeds(req)
        data = self.encode_job(req)
        traceparent = traceparent or tracecontext.new_traceparent()
        headers = {
            "Nats-Msg-Id": req.request_id,
            codec.CONTENT_TYPE: codec.content_type(self.encoding),
            tracecontext.HEADER: traceparent,
        }
        if batch_frames and req.reply_to is not None and self.encoding == "msgpack":
            headers[codec.FRAME_BATCH_HEADER] = frame_batch_subject(req.reply_to)
        subject = await self._addressing.subject(self.js, role, req, traceparent, instance)
        return await self._store(subject, data, headers, req.request_id)

    async def submit_shard(self, shard: ShardJob, *, traceparent: str | None = None) -> PubAck:
        """Publish a shard (many detached requests of one model: schemas/shard.py) to the model's
        shard queue, durably and with `Nats-Msg-Id` = its id, as `submit` publishes a job. Only
        workers that say so in the registry (`InstanceRecord.shard_lines`) pull that queue."""
        headers = {
            "Nats-Msg-Id": shard.request_id,
            codec.CONTENT_TYPE: codec.content_type(self.encoding),
            codec.SHARD_REQUESTS_HEADER: str(len(shard.requests)),
            tracecontext.HEADER: traceparent or tracecontext.new_traceparent(),
        }
        subject = self.names.jobs(SHARD_QUEUE, shard.model)
        return await self._store(subject, self.encode_job(shard), headers, shard.request_id)

    async def _store(self, subject: str, data: bytes, headers: dict[str, str], msg_id: str) -> PubAck:
        maybe_stored = False

        async def publish() -> PubAck:
            nonlocal maybe_stored
            try:
                return await self.js.publish(subject, data, headers=headers, timeout=2.0)
            except _MAYBE_STORED:  # sent, and no answer; the other failures stored nothing
                maybe_stored = True
                raise

        what = f"publishing {msg_id}"
        ack = await retried(publish, errors=_PUBLISH_RETRIED, within=self.publish_timeout, what=what)
        if ack.duplicate and maybe_stored:
            # An earlier attempt was stored and only its PubAck lost (a busy server): the job is
            # this call's, not an earlier submitter's, or generate() would not cancel it on leaving.
            ack = dataclasses.replace(ack, duplicate=False)
        return ack

    async def offload_embeds(self, req: GenerateRequest) -> tuple[GenerateRequest, str | None]:
        """`req` with inline prompt embeddings moved to the object store when they are too big for
        one message (or than `embeds_inline_max`); also the object's name, None when nothing moved.
        Objects expire with the queue's max_age; `generate()` deletes its own when the request ends."""
        prompt = req.prompt
        if not isinstance(prompt, EmbedsPrompt) or prompt.data is None:
            return req, None
        too_big = self.embeds_inline_max is not None and len(prompt.data) > self.embeds_inline_max
        if not too_big:
            try:
                self.encode_job(req)
                return req, None
            except PayloadTooLarge:
                pass
        store = await embeds_store(
            self.js, self.names, ttl=self._policy.setting("max_age"), replicas=self._policy.replicas
        )
        name = f"{req.request_id}/{uuid.uuid4().hex[:12]}"
        ref = await upload(store, name, prompt)
        return msgspec.structs.replace(req, prompt=ref), name

    async def _drop_embeds(self, name: str) -> None:
        try:
            store = await self.js.object_store(self.names.embeds_store)
            await store.delete(name)
        except Exception as exc:  # it expires with the store's TTL anyway
            log.info("could not delete embeddings object %s: %s", name, exc)

    async def cancel(
        self, request_id: str, reason: str | None = None, *, traceparent: str | None = None
    ) -> None:
        """Stop a request wherever it is: running (live notice) or still queued (durable record).

        The record is stored first: a worker that pulls the job between the two finds it, and one
        that is already running it gets the notice. It goes to the request's own cancel subject,
        not its log: producers may not write the log, where a record could pass for a result."""
        subject = self.names.cancelled(request_id)
        try:
            await self.js.publish(subject, codec.encode(Cancelled(attempt=0, reason=reason)), timeout=2.0)
        except nats.errors.NoRespondersError:
            raise JetStreamUnavailable(
                f"cancel of {request_id}: no stream stores {subject}: the workers predate durable "
                f"cancels (stream {self.names.cancels_stream}); start a worker of this version, which "
                "creates it. A running request was still told to stop; a queued one will run"
            ) from None
        finally:  # a running request stops even when the record could not be stored
            await self.nc.publish(
                self.names.cancel(request_id),
                codec.encode(CancelRequest(request_id=request_id, reason=reason)),
                headers={tracecontext.HEADER: traceparent} if traceparent else None,
            )

    # results of requests, whoever was listening

    async def result(self, request_id: str) -> Result | None:
        """How the request ended, if it has (stored for `results_max_age`)."""
        return await results.result(self.js, self.names, request_id)

    def attach(self, request_id: str, accept_timeout: float | None = None) -> AsyncGenerator[Frame, None]:
        """The frames of a request someone else submitted (or an earlier run of this program),
        read from the request log: everything delivered so far, then live until it ends. Raises
        AcceptTimeout when no worker claims it within `accept_timeout` seconds (None: wait)."""
        return results.attach(self.js, self.names, request_id, accept_timeout)

    async def wait_result(self, request_id: str, timeout: float | None = None) -> Result:
        with anyio.fail_after(timeout):
            async with aclosing(self.attach(request_id)) as frames:
                async for frame in frames:
                    if isinstance(frame, (FinalFrame, ErrorFrame)):
                        break
        result = await self.result(request_id)
        if result is None:  # pragma: no cover - the log ended with a result
            raise RequestFailed(ErrorCode.INTERNAL, f"{request_id} ended without a stored result")
        return result

    # streaming

    async def generate(
        self,
        req: GenerateRequest,
        *,
        role: str = "generate",
        accept_timeout: float | None = None,
        traceparent: str | None = None,
        instance: str | None = None,
    ) -> AsyncGenerator[Frame, None]:
        """Submit `req` and yield its frames up to and including the final or error frame.

        If the worker dies, the request continues on another one and the stream goes on with
        the next frame (an AcceptedFrame with a higher attempt marks the move). Leaving the loop
        early cancels the request. Errors from the worker arrive as an ErrorFrame. Raises
        AcceptTimeout when no worker takes the job (again) within `accept_timeout` (None: wait),
        and WorkerSilent when the worker goes silent and `migrate` is off. `instance`: address the
        job to one worker instance (see `submit`).
        """
        check_role(role)
        token = uuid.uuid4().hex
        req = self._replying_here(req, token)
        inbox = self._inboxes.open(token)
        traceparent = traceparent or tracecontext.new_traceparent()
        ours = True
        seq = None
        uploaded = None
        try:
            req, uploaded = await self.offload_embeds(req)
            ack = await self.submit(
                req, role=role, traceparent=traceparent, batch_frames=True, instance=instance
            )
            if ack.duplicate:
                # The job exists already (submitted before, maybe by a run that died): follow it.
                ours = False  # nothing of ours to cancel: the request belongs to its first submitter
                async with aclosing(self.attach(req.request_id, accept_timeout)) as frames:
                    async for frame in frames:
                        yield frame
                return
            seq = Sequencer(
                req.request_id,
                time.monotonic(),
                encoding=self.encoding,
                migrate=self.migrate,
                accept_timeout=accept_timeout,
                heartbeat_timeout=self.heartbeat_timeout,
                probe_after=self.probe_after,
                reconnects=self.nc.stats.get("reconnects", 0),
                choices=req.sampling.n,
            )
            while True:
                inbox.deadline = seq.deadline
                data = await inbox.get()
                now = time.monotonic()
                if isinstance(data, Msg):  # in order: the frames before the question are counted
                    await self._answer(data, seq.resume(data.data))
                    continue
                if data is None:
                    decision = seq.wake(
                        now, connected=self.nc.is_connected, reconnects=self.nc.stats.get("reconnects", 0)
                    )
                else:
                    decision = seq.receive(data, now)
                    if decision.drop is not None:
                        log.debug("request %s: frame dropped (%s)", req.request_id, decision.drop)
                if decision.asks:
                    decision = await self._carry_out(seq, decision)
                for frame in decision.emit:
                    yield frame
                if decision.error is not None:
                    raise decision.error
                if decision.end:
                    return
        finally:
            self._inboxes.close(token)
            await self._leave(req, traceparent, ours and not (seq is not None and seq.finished), uploaded)

    async def _answer(self, query: Msg, answer: Delivered | None) -> None:
        if answer is not None:
            try:
                await self.nc.publish(query.reply, codec.encode(answer, self.encoding))
            except Exception as exc:  # the worker then continues from the log
                log.warning("could not answer a worker's resume query: %s", exc)

    def _replying_here(self, req: GenerateRequest, token: str) -> GenerateRequest:
        if req.reply_to is not None:  # frames sent there would reach no inbox of this call's
            raise ValueError("generate() sets reply_to itself; leave it None (or use submit())")
        return msgspec.structs.replace(req, reply_to=self._inboxes.subject(token))

    async def _carry_out(self, seq: Sequencer, decision: Decision) -> Decision:
        """What the sequencer asks of the world (the log, a ping, a NAK), reported back until it has decided."""
        rid = seq.request_id
        while decision.asks:
            if decision.fill is not None:
                try:
                    filled = await results.fill_gap(
                        self.js, self.names, rid, seq.seen, *decision.fill, n=seq.choices
                    )
                except RequestFailed as exc:  # a forged result in the log: the request is failed
                    return Decision(error=exc)
                decision = seq.filled(filled, time.monotonic())
            elif decision.probe is not None:
                decision = seq.probed(await self._gone(decision.probe), time.monotonic())
            else:
                ended = await results.result_quietly(self.js, self.names, rid)
                decision = seq.looked_up(ended, time.monotonic())
        if decision.gone is not None:
            log.info("request %s: worker %s is gone; moving the job on", rid, decision.gone)
        if decision.nak is not None and decision.nak.startswith(f"$JS.ACK.{self.names.jobs_stream}."):
            # a frame names the subject: NAK jobs only, whatever a worker (or anyone) claims
            with anyio.CancelScope(shield=True):
                try:
                    await self.nc.publish(decision.nak, b"-NAK")
                except Exception as exc:  # e.g. not a valid subject; the job then moves after ack_wait
                    log.warning("request %s: could not hand its job back: %s", rid, describe(exc))
        return decision

    async def _gone(self, worker: str) -> bool:
        """Whether the worker's connection is gone (False while closing: nobody to act on it)."""
        return False if self._pings is None else await self._pings.gone(worker)

    async def _leave(
        self, req: GenerateRequest, traceparent: str, cancel: bool, uploaded: str | None
    ) -> None:
        """After a request's stream, whatever ended it: stop the request if it still runs, drop its upload."""
        if self._nc is None or not self._nc.is_connected:
            return
        with anyio.CancelScope(shield=True):
            if cancel:
                try:
                    await self.cancel(
                        req.request_id, reason="producer stopped listening", traceparent=traceparent
                    )
                except Exception as exc:  # the request still ends: its worker stops on close
                    log.warning("could not send cancel for %s: %s", req.request_id, exc)
            if uploaded is not None:
                await self._drop_embeds(uploaded)

    async def complete(self, req: GenerateRequest, **kwargs: Any) -> Completion:
        """Run `req` to the end and return the assembled result; error frames raise RequestFailed."""
        async with aclosing(self.generate(req, **kwargs)) as frames:
            return await assemble(req, frames, req.sampling.n)
