"""The worker runtime: pull jobs for one (role, model), run them, settle them, stop cleanly.

Every task belongs to one task group owned by `Worker.serve`; jobs run in a nested group so
that stopping can wait for them, then hand back the ones still running.

Only the lifecycle and the job path live here, so that a job's way from pull to settle reads in
one place. Beside it: the running set, with cancel, ping and heartbeats (running.py),
dead-lettering (deadletters.py), the log resync after reconnects (recovery.py), and the status
reply (status.py).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from ..errors import EngineDead, EngineRequestError, RequestRejected
from ..schemas import (
    CancelRequest,
    Claim,
    EmbedsPrompt,
    ErrorCode,
    GenerateRequest,
    Handoff,
    Result,
    WorkerStatus,
)
from ..subjects import codec
from ..subjects.names import Names
from ..subjects.setup import QueuePolicy, ensure_consumer, ensure_streams
from .adapterqueues import AdapterQueues
from .control import ControlServer, reply_encoding
from .deadletters import DeadLetters
from .earlystart import EarlyStart
from .embeds import EmbedsLoader
from .engine import Engine, EnginePrompt
from .enginecontrol import EngineControl
from .frames import FrameSink
from .jobs import Job, RejectedJob, decode_request
from .kvevents import KvEventRelay
from .lora import LoraManager, LoraSettings
from .puller import Puller
from .recovery import resync_after_reconnects
from .registry import RegistryKeeper, instance_record, load_reports, model_card
from .requestlog import History, LogUnavailable, RequestLog, analyze
from .roles import GenerateRole, Outcome
from .running import Running, RunningRequests, runs_it
from .status import worker_status
from .tracing import Hop, TracePublisher, outcome_of

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ENGINE_DEAD = 3


class WorkerConfig(msgspec.Struct, kw_only=True):
    namespace: str = "default"
    slots: int = 0
    """Jobs this worker runs at once; it never holds more un-acked jobs than this.
    0: the engine's batch limit (max_num_seqs)."""
    heartbeat_interval: float = 0.5
    """A quiet request gets a heartbeat frame this often."""
    max_migrations: int = 3
    """Default migration budget of a request: how often workers may die under it."""
    grace_period: float = 30.0
    """On SIGTERM, how long running requests may take to finish before they are handed back."""
    health_interval: float = 5.0
    health_timeout: float = 10.0
    pull_expires: float = 3.0
    registry_interval: float = 2.0
    """Seconds between registry heartbeats; a dead worker's record stops counting after 3 of them."""
    metrics_port: int | None = None
    """Prometheus endpoint port; 0 picks a free one (written to the registry), None: no endpoint."""
    instance: str | None = None
    max_embeds_bytes: int | None = None
    """Largest embeddings prompt accepted; None: a full context of float32 rows (capped at 1 GiB)."""
    policy: QueuePolicy = msgspec.field(default_factory=QueuePolicy)
    lora: LoraSettings = msgspec.field(default_factory=LoraSettings)


def new_instance_id() -> str:
    host = socket.gethostname().split(".")[0][:24] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(self, nc: NATS, engine: Engine, config: WorkerConfig) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=10)
        self.engine = engine
        self.config = config
        self.names = Names(config.namespace)
        self.role = GenerateRole(engine)
        self.model = engine.facts.model
        self.instance = config.instance or new_instance_id()
        self.slots = config.slots if config.slots > 0 else (engine.facts.max_num_seqs or 64) * len(engine.facts.dp_ranks)
        self.state = "starting"
        self.sleeping = False
        self.ready = False
        self._paused = False
        self.started_at = time.time()
        self._busy = 0
        self._running = RunningRequests(nc)
        self._jobs_tg: TaskGroup | None = None
        self._idle = anyio.Event()
        self._stop = anyio.Event()
        self._engine_dead = False
        self._puller: Puller | None = None
        self.exit_code = EXIT_OK
        self.log = RequestLog(nc, self.names)
        self.counters = {
            "pulled": 0, "acked": 0, "completed": 0, "deferred": 0, "resumed": 0, "handed_back": 0,
            "dead_lettered": 0, "cancelled": 0, "superseded": 0, "duplicates": 0, "frames_sent": 0,
        }
        self.errors: collections.Counter[str] = collections.Counter()
        self.dead_letters = DeadLetters(self)
        self.metrics_url: str | None = None
        self.adapters: list[str] = []
        self.control = ControlServer(nc, self.names, self.instance, self.model)
        self.registry = RegistryKeeper(
            nc, self.names, lambda: instance_record(self), lambda: model_card(self), lambda: load_reports(self),
            interval=config.registry_interval,
        )
        self.engine_control = EngineControl(self)
        self.traces = TracePublisher(nc, self.names)
        self.embeds = EmbedsLoader(self.js, self.names, engine.facts, config.max_embeds_bytes)
        self.services: list[Callable[[], Awaitable[None]]] = []
        """Long-running companions (KV-event relay, adapter reconciler); started once ready."""
        self.lora = LoraManager(self, config.lora)
        self.adapter_queues = AdapterQueues(self)
        self.kv_events = KvEventRelay(self)

    # lifecycle

    async def serve(self, *, handle_signals: bool = True) -> int:
        """Run until stopped (signal, `stop()`, or engine death); returns the process exit code."""
        await ensure_streams(self.js, self.names, self.config.policy)
        if self.config.metrics_port is not None:
            from .metrics import serve_metrics

            self.metrics_url = serve_metrics(self, self.config.metrics_port)
        consumer = await ensure_consumer(self.js, self.names, self.role.role, self.model, self.config.policy)
        handlers = {
            self.names.cancel_all: self._running.on_cancel,
            self.names.control("status"): self._on_status,
            self.names.instance_control(self.instance, "status"): self._on_status,
            self.names.instance_control(self.instance, "ping"): self._running.on_ping,
            self.names.max_deliveries_advisory(self.role.role, self.model):
                self.dead_letters.on_max_deliveries,
        }
        subs = [await self.nc.subscribe(subject, cb=cb) for subject, cb in handlers.items()]
        self._puller = Puller(
            self.nc,
            self.names.jobs_stream,
            consumer,
            free_slots=lambda: 0 if self._paused else self.slots - self._busy,
            on_job=self._on_job,
            expires=self.config.pull_expires,
        )
        log.info(
            "worker %s serving %r (role %s, %d slots) from consumer %s",
            self.instance, self.model, self.role.role, self.slots, consumer,
        )
        try:
            async with anyio.create_task_group() as tg:
                if handle_signals:
                    tg.start_soon(self._watch_signals)
                with anyio.fail_after(self.config.health_timeout):
                    await self.engine.check_health()  # ready means the engine answered, too
                tg.start_soon(self.engine_control.monitor)
                tg.start_soon(self._running.tick, self.config.heartbeat_interval, self.config.policy.ack_wait)
                tg.start_soon(resync_after_reconnects, self.nc, self.log, self.instance, self._running)
                await self.control.start(tg)
                for service in self.services:
                    tg.start_soon(service)
                async with anyio.create_task_group() as jobs:
                    self._jobs_tg = jobs
                    jobs.start_soon(self._puller.run)
                    jobs.start_soon(self.adapter_queues.sync, list(self.adapters))
                    self.state = "serving"
                    self.ready = True
                    tg.start_soon(self.registry.run)
                    await self._stop.wait()
                    self.ready = False
                    await self._wind_down()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.control.stop()
                await self.registry.remove(self.instance)
                for sub in subs:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                with contextlib.suppress(Exception):
                    await self.nc.flush(timeout=5)
        self.state = "engine_dead" if self._engine_dead else "stopped"
        log.info("worker %s stopped (%s), exit code %d", self.instance, self.state, self.exit_code)
        return self.exit_code

    def stop(self) -> None:
        """Begin a graceful stop: no more pulls, running requests get the grace period."""
        self._stop.set()

    async def _wind_down(self) -> None:
        assert self._puller is not None
        self._puller.stop()
        self.adapter_queues.stop()
        if self._engine_dead:
            self._running.hand_back_all()
            return
        self.state = "draining"
        self.registry.beat_now()
        log.info("draining: %d running, grace %.1fs", len(self._running), self.config.grace_period)
        await self.wait_idle(hand_back_after=self.config.grace_period)

    def public_state(self) -> str:
        if self.sleeping:
            return "sleeping"
        return self.state if self.state in ("starting", "serving") else "draining"

    def pause_pulling(self, paused: bool) -> None:
        self._paused = paused
        if self._puller is not None:
            self._puller.wake()
        self.adapter_queues.wake()

    async def wait_idle(self, hand_back_after: float) -> None:
        """Until no job runs here; jobs still running after `hand_back_after` seconds are handed back."""
        with anyio.move_on_after(hand_back_after):
            while self._busy:
                self._idle = anyio.Event()
                await self._idle.wait()
        if self._running:
            log.info("handing back %d running jobs", len(self._running))
            self._running.hand_back_all()
        while self._busy:
            self._idle = anyio.Event()
            await self._idle.wait()

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if not self._stop.is_set():
                    log.info("%s: stopping gracefully", signal.Signals(signum).name)
                    self.stop()
                else:
                    log.info("%s again: handing back running jobs now", signal.Signals(signum).name)
                    self._running.hand_back_all()

    def _on_engine_dead(self, why: str) -> None:
        if self._engine_dead:
            return
        log.error("engine is dead (%s): handing back %d jobs and exiting", why, len(self._running))
        self._engine_dead = True
        self.exit_code = EXIT_ENGINE_DEAD
        self.state = "engine_dead"
        self._running.hand_back_all()
        self.stop()

    # jobs

    def _on_job(self, msg: Msg) -> None:
        self._busy += 1
        self.counters["pulled"] += 1
        assert self._jobs_tg is not None
        self._jobs_tg.start_soon(self._run_job, msg)

    async def _run_job(self, msg: Msg) -> None:
        try:
            job = Job(msg)
            hop = Hop(msg)
            try:
                req, encoding = decode_request(msg.data, msg.headers)
            except RejectedJob as exc:
                frames = FrameSink(self.nc, exc.reply_to, exc.encoding, exc.request_id or "", attempt=job.attempt,
                                   headers=hop.header)
                await self.dead_letters.reject(job, frames, exc, exc.request_id)
                return
            if req.model != self.model and req.adapter is None and self.adapter_queues.serves(req.model):
                req = msgspec.structs.replace(req, model=self.model, adapter=req.model)  # from the adapter's queue
            if req.request_id in self._running:
                # A second job with this id while the first runs here: let the first finish.
                log.warning("request %s delivered again while running here; holding the copy", req.request_id)
                self.counters["duplicates"] += 1
                await job.nak(delay=self.config.policy.ack_wait)
                return
            frames = FrameSink(
                self.nc, req.reply_to, encoding, req.request_id,
                attempt=job.attempt, log_subject=self.names.request_log(req.request_id), headers=hop.header,
            )
            await self._serve(job, req, frames)
            self._spawn(self.traces.publish, hop.record(
                request_id=req.request_id, instance=self.instance, model=self.model, attempt=frames.attempt,
                frames=frames, outcome=outcome_of(frames, job.settled_how),
            ))
        finally:
            self._busy -= 1
            if self._busy == 0:
                self._idle.set()
            if self._puller is not None:
                self._puller.wake()
            self.adapter_queues.wake()

    async def _serve(self, job: Job, req: GenerateRequest, frames: FrameSink) -> None:
        rid = req.request_id
        run = Running(job, frames)
        self._running[rid] = run
        assert self._jobs_tg is not None
        early: EarlyStart[Outcome] = EarlyStart(
            self._jobs_tg.start_soon, frames, lambda prompt: self._generate(req, frames, prompt, History())
        )
        try:
            with run.scope:
                history, prompt_ids = await self._prepare(req, early)
                if history.result is not None:
                    await self._replay_result(job, frames, history.result)
                    return
                if history.cancelled is not None:
                    run.cancel_reason = history.cancelled.reason or "cancelled before it started"
                    return
                owner = history.owner
                if owner not in (None, self.instance) and await runs_it(self.nc, self.names, owner, rid):
                    # Redelivered while its worker still runs it (a restored broker does this):
                    # leave it there; that worker's ack settles this delivery too.
                    log.info("request %s still runs on %s; leaving it there", rid, owner)
                    self.counters["deferred"] += 1
                    await job.nak(delay=self.config.policy.ack_wait)
                    return
                budget = self.config.max_migrations if req.max_migrations is None else req.max_migrations
                if history.deaths > budget:
                    raise RequestRejected(
                        ErrorCode.MIGRATION_BUDGET_EXHAUSTED,
                        f"workers died under this request {history.deaths} times; its migration budget is "
                        f"{budget} (delivery {job.attempt})",
                    )
                if history.last_attempt >= job.attempt:
                    job.attempt = frames.attempt = history.last_attempt + 1
                if history.claimed:
                    # An older attempt may still be alive (stalled, partitioned): it must stop.
                    await self.nc.publish(
                        self.names.cancel(rid),
                        codec.encode(CancelRequest(request_id=rid, reason="superseded", below_attempt=job.attempt)),
                    )
                await self.log.write(rid, Claim(attempt=job.attempt, worker=self.instance, at=time.time()))
                if history.frames:
                    self.counters["resumed"] += 1
                    log.info("request %s: continuing after %d delivered tokens (delivery %d)",
                             rid, sum(len(f.token_ids) for f in history.frames), job.attempt)
                    await frames.replay(history.frames)
                frames.seq = history.last_seq
                await frames.accepted(
                    self.instance, self.model, job_ack=job.msg.reply,
                    resumed_tokens=sum(len(f.token_ids) for f in history.frames if f.index == 0),
                )
                if early.started:
                    outcome = await early.outcome()
                else:
                    outcome = await self._generate(req, frames, prompt_ids, history)
                final = frames.final_frame(outcome.choices, outcome.usage)
                run.ended = True
                await self.log.store_result(rid, Result(
                    attempt=job.attempt, final=final, token_ids=outcome.token_ids, text=outcome.text,
                    worker=self.instance, migrations=history.deaths + history.handoffs,
                ))
                await frames.send(final)
                await job.ack()
                self.counters["acked"] += 1
                self.counters["completed"] += 1
                self._spawn(self.log.compact, rid)
        except LogUnavailable as exc:
            log.warning("request %s waits: %s", rid, exc)
            self.counters["deferred"] += 1
            with anyio.CancelScope(shield=True):
                await job.nak(delay=1.0)
        except RequestRejected as exc:
            await self.dead_letters.reject(job, frames, exc, rid)
        except EngineRequestError as exc:
            await self.dead_letters.reject(job, frames, exc, rid, code=ErrorCode.ENGINE_ERROR)
        except EngineDead as exc:
            run.hand_back = True
            self._on_engine_dead(str(exc))
        except Exception as exc:  # a bug: tell the producer, keep the job for inspection
            log.exception("request %s failed inside jetllm", rid)
            bug = RequestRejected(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            await self.dead_letters.reject(job, frames, bug, rid)
        finally:
            with anyio.CancelScope(shield=True):
                await early.close()
            self._running.pop(rid, None)
            self.counters["frames_sent"] += frames.frames_sent
            with anyio.CancelScope(shield=True):
                await self._settle_interrupted(job, run, rid)

    async def _generate(self, req: GenerateRequest, frames: FrameSink, prompt: EnginePrompt, history: History) -> Outcome:
        async with self.lora.use(req) as adapter:
            return await self.role.run(req, frames, prompt, history, adapter)

    async def _prepare(self, req: GenerateRequest, early: EarlyStart[Outcome]) -> tuple[History, EnginePrompt]:
        """The request's history and its rendered prompt, looked up side by side.

        The engine starts on the prompt at once (see earlystart.py) unless the log already
        showed the request is not fresh.
        """
        self.role.check_model(req)
        got: dict[str, Any] = {}

        async def fetch(name: str, fn: Any) -> None:
            try:
                got[name] = await fn()
            except Exception as exc:  # re-raised below, unwrapped
                got[name] = exc
                return
            if name == "prompt" and got.get("last") is None:  # the log is not read yet, or empty
                early.start(got["prompt"])

        prompt = req.prompt
        async with anyio.create_task_group() as tg:
            tg.start_soon(fetch, "last", lambda: self.log.last(req.request_id))
            if isinstance(prompt, EmbedsPrompt):
                tg.start_soon(fetch, "prompt", lambda: self.embeds.load(prompt))
            else:
                tg.start_soon(fetch, "prompt", lambda: self.engine.render(prompt))
        last = got["last"]
        if last is not None:
            await early.close()
        if isinstance(last, Exception):
            raise last
        if last is None:
            history = History()
        elif isinstance(last, Result):
            history = analyze([last])
        else:
            history = await self.log.history(req.request_id)
        if isinstance(got["prompt"], Exception):
            if history.result is not None or history.cancelled is not None:
                return history, []  # it ended: its prompt (an expired embeddings object, say) is not needed
            raise got["prompt"]
        return history, got["prompt"]

    async def _replay_result(self, job: Job, frames: FrameSink, result: Result) -> None:
        """The request already finished (this is a redelivery or a resubmission): answer from its result."""
        log.info("request %s already finished; answering from its stored result", frames.request_id)
        await frames.replay_result(result, self.instance, self.model, job_ack=job.msg.reply)
        await job.ack()
        self.counters["acked"] += 1

    async def _settle_interrupted(self, job: Job, run: Running, rid: str) -> None:
        if job.settled or run.superseded:
            if run.superseded:
                self.counters["superseded"] += 1  # the job belongs to a newer delivery now
            return
        # Counted before the awaits below: a status reader never sees the request gone but uncounted.
        if run.hand_back:
            self.counters["handed_back"] += 1
            await self._pulling_stopped()
            if not self._engine_dead:  # a planned move; an engine death counts against the budget
                await self.log.write(rid, Handoff(attempt=job.attempt, reason="worker draining"))
            await job.nak()
        elif run.cancel_reason is not None:
            self.counters["cancelled"] += 1
            err = run.frames.error_frame(ErrorCode.CANCELLED, run.cancel_reason)
            await self.log.store_result(rid, Result(attempt=job.attempt, error=err, worker=self.instance))
            await run.frames.send(err)
            await job.term()

    def _spawn(self, fn, *args) -> None:
        if self._jobs_tg is not None:
            self._jobs_tg.start_soon(fn, *args)

    async def _pulling_stopped(self) -> None:
        """Wait (briefly) until this worker can receive no more jobs, so a handed-back job goes elsewhere."""
        if self._puller is not None:
            with anyio.move_on_after(self.config.pull_expires + 2):
                for puller in [self._puller, *self.adapter_queues.pullers]:
                    await puller.done.wait()

    # control

    def status(self) -> WorkerStatus:
        return worker_status(self)

    async def _on_status(self, msg: Msg) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, codec.encode(self.status(), reply_encoding(msg)))
