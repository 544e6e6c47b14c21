"""The worker runtime: pull jobs for one (role, model), run them, settle them, stop cleanly.

Every task belongs to one task group owned by `Worker.serve`; jobs run in a nested group so
that stopping can wait for them, then hand back the ones still running.

Only the lifecycle lives here: wiring, serving, pausing, draining, stopping. Beside it: one job's
way from pull to settle (jobrun.py), the running set, with cancel, ping and heartbeats
(running.py), dead-lettering (deadletters.py), the log resync after reconnects (recovery.py),
and the status reply (status.py).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from ..aio import contained, describe, supervised
from ..schemas import InstanceState, WorkerStatus
from ..subjects import codec
from ..subjects.names import Names
from ..subjects.setup import QueuePolicy, ensure_consumer, ensure_streams
from .adapterqueues import AdapterQueues
from .control import ControlServer, reply_encoding
from .deadletters import DeadLetters
from .embeds import EmbedsLoader
from .engine import Engine
from .enginecontrol import EngineControl
from .jobrun import JobRunner
from .kvevents import KvEventRelay
from .lora import LoraManager, LoraSettings
from .puller import Puller
from .recovery import resync_after_reconnects
from .registry import RegistryKeeper, instance_record, load_reports, model_card
from .requestlog import RequestLog
from .roles import GenerateRole
from .running import RunningRequests
from .status import worker_status
from .tracing import TracePublisher

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ENGINE_DEAD = 3
EXIT_CRASHED = 4
STOP_LEFTOVERS_TIMEOUT = 10.0


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
        self.served_at: float | None = None
        self.stop_reason = "stop requested"
        self.log = RequestLog(nc, self.names)
        self.counters = {
            "pulled": 0, "acked": 0, "completed": 0, "deferred": 0, "resumed": 0, "handed_back": 0,
            "dead_lettered": 0, "cancelled": 0, "superseded": 0, "duplicates": 0, "frames_sent": 0,
        }
        self.errors: collections.Counter[str] = collections.Counter()
        self.dead_letters = DeadLetters(self)
        self.jobs = JobRunner(self)
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
        self.services: list[Callable[[], Coroutine[Any, Any, None]]] = []
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
        subs = [
            await self.nc.subscribe(subject, cb=functools.partial(contained, f"handler of {subject}", cb))
            for subject, cb in handlers.items()
        ]
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
                tg.start_soon(supervised, "engine monitor", self.engine_control.monitor)
                tg.start_soon(supervised, "heartbeats", self._running.tick, self.config.heartbeat_interval,
                              self.config.policy.ack_wait)
                tg.start_soon(supervised, "log resync", resync_after_reconnects, self.nc, self.log, self.instance,
                              self._running)
                await self.control.start(tg)
                for service in self.services:
                    tg.start_soon(supervised, getattr(service, "__qualname__", "service"), service)
                async with anyio.create_task_group() as jobs:
                    self._jobs_tg = jobs
                    jobs.start_soon(self._puller.run)
                    jobs.start_soon(contained, "adapter queues", self.adapter_queues.sync, list(self.adapters))
                    await self.registry.announce(state="serving", ready=True)
                    self.state = "serving"
                    self.ready = True
                    self.served_at = time.time()
                    tg.start_soon(supervised, "registry", self.registry.run)
                    await self._stop.wait()
                    self.ready = False
                    await self._wind_down()
                    # Only housekeeping may remain (pullers closing, log writes); it cannot hang a stop.
                    jobs.cancel_scope.deadline = anyio.current_time() + STOP_LEFTOVERS_TIMEOUT
                if jobs.cancel_scope.cancelled_caught:
                    log.error("tasks still running %.0fs after the drain were cancelled", STOP_LEFTOVERS_TIMEOUT)
                self._jobs_tg = None
                await self.control.stop()  # before the group closes: no verb may start in a closed group
                tg.cancel_scope.cancel()
        except Exception as exc:
            if self.served_at is None:
                raise  # never served: the caller reports a failed start
            # Every job, verb and companion has its own barrier, so this is a bug in the runtime.
            self.exit_code = EXIT_CRASHED
            self.stop_reason = f"crashed after serving {time.time() - self.served_at:.0f}s: {describe(exc)}"
            log.critical("worker %s %s", self.instance, self.stop_reason, exc_info=exc)
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
        log.log(logging.INFO if self.exit_code == EXIT_OK else logging.ERROR,
                "worker %s stopped (%s), exit code %d", self.instance, self.stop_reason, self.exit_code)
        return self.exit_code

    def stop(self, reason: str = "stop requested") -> None:
        """Begin a graceful stop: no more pulls, running requests get the grace period."""
        if not self._stop.is_set():
            self.stop_reason = reason
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

    def public_state(self) -> InstanceState:
        if self.sleeping:
            return "sleeping"
        if self.state == "starting":
            return "starting"
        return "serving" if self.state == "serving" else "draining"

    def pause_pulling(self, paused: bool) -> None:
        self._paused = paused
        if self._puller is not None:
            self._puller.wake()
        self.adapter_queues.wake()

    async def credit_returned(self) -> None:
        """Until no puller holds pull credit (after a pause): no job can be delivered here any more."""
        with anyio.move_on_after(self.config.pull_expires + 2):
            while any(p.outstanding for p in [self._puller, *self.adapter_queues.pullers] if p is not None):
                await anyio.sleep(0.01)

    async def wait_idle(self, hand_back_after: float) -> None:
        """Until no job runs here; jobs still running after `hand_back_after` seconds are handed back."""
        with anyio.move_on_after(hand_back_after):
            while self._busy:
                await self._idle.wait()
        if self._running:
            log.info("handing back %d running jobs", len(self._running))
            self._running.hand_back_all()
        while self._busy:
            await self._idle.wait()

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if not self._stop.is_set():
                    log.info("%s: stopping gracefully", signal.Signals(signum).name)
                    self.stop(f"{signal.Signals(signum).name}: drained")
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
        self.stop(f"engine dead: {why}")

    # jobs

    def _on_job(self, msg: Msg) -> None:
        self._busy += 1
        self.counters["pulled"] += 1
        assert self._jobs_tg is not None
        self._jobs_tg.start_soon(self._run_job, msg)

    async def _run_job(self, msg: Msg) -> None:
        try:
            await self.jobs.run(msg)
        except Exception:  # the barrier inside run() failed too; JetStream redelivers after ack_wait
            log.exception("a job could not be handled or failed")
        finally:
            self._busy -= 1
            if self._busy == 0:  # wakes every waiter (a sleep and a drain may wait at once)
                self._idle.set()
                self._idle = anyio.Event()
            if self._puller is not None:
                self._puller.wake()
            self.adapter_queues.wake()

    def _spawn(self, fn, *args) -> None:
        if self._jobs_tg is not None:
            self._jobs_tg.start_soon(contained, getattr(fn, "__qualname__", "a background step"), fn, *args)

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
