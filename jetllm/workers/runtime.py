"""The worker runtime, and its composition root: pull jobs for one (role, model), run them through
the job protocol, stop cleanly.

`Worker.__init__` builds every part with the narrow arguments it needs (no part gets the worker),
and `_verbs`, `_subscriptions` and `_services` list, in one place each, the control verbs, the
subscriptions and the long-running companions; no constructor registers anything by itself, so
the order of the lines in `__init__` only follows what each part is built from. The runtime
knows no role: it serves whatever `Role` it is given (roles/), so adding a role does not touch it.

Every task belongs to one task group owned by `Worker.serve`; jobs run in a nested group so that
stopping can wait for them, then hand back the ones still running.
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
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from .. import taskdump
from ..aio import contained, describe, fail_after, supervised, task_group
from ..schemas import HealthCheck, LoraLoad, LoraUnload, SleepRequest, TasksReport, TaskWait, WorkerStatus
from ..subjects.consumers import ensure_consumer
from ..subjects.denials import checked
from ..subjects.names import SHARD_QUEUE, Names
from ..subjects.setup import ensure_streams
from .adapterqueues import AdapterQueues
from .cachedblocks import CachedBlocks
from .config import WorkerConfig
from .context import Counters, WorkerContext
from .control import ControlServer
from .deadletters import DeadLetters
from .directed import DirectedQueue
from .embeds import EmbedsLoader
from .engine import Engine
from .enginecontrol import EngineControl
from .exhausted import Exhausted
from .framebatch import FrameBatcher
from .kvevents import KvEventRelay
from .lora import LoraManager
from .protocol import JobDeps, intake
from .pulls import Pulls
from .recovery import resync_after_reconnects
from .registry import RegistryKeeper
from .reports import Reports, answer_status
from .requestlog import RequestLog
from .roles import ROLES, Role, RoleDeps, role_named
from .running import RunningRequests
from .shards import shard_intake, shard_room
from .slots import Slots
from .state import EXIT_CRASHED, EXIT_ENGINE_DEAD, EXIT_OK, Lifecycle, WorkerState
from .sweeper import Sweeper
from .tasks import JobTasks
from .tracing import TracePublisher

__all__ = ["EXIT_CRASHED", "EXIT_ENGINE_DEAD", "EXIT_OK", "STOP_LEFTOVERS_TIMEOUT", "Worker", "WorkerConfig"]

log = logging.getLogger(__name__)

STOP_LEFTOVERS_TIMEOUT = 10.0

Verb = tuple[str, Callable[[Any], Awaitable[msgspec.Struct]], type[msgspec.Struct] | None]


def new_instance_id() -> str:
    host = socket.gethostname().split(".")[0][:24] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(
        self, nc: NATS, engine: Engine, config: WorkerConfig, *, role: type[Role] | None = None
    ) -> None:
        """`role`: the role to serve (default: `config.role` from `roles.ROLES`)."""
        role_cls = role or role_named(config.role, ROLES)
        facts = engine.facts
        self.nc = nc
        self.engine = engine
        self.config = config
        self.ctx = ctx = WorkerContext(
            nc=nc,
            js=nc.jetstream(timeout=10),
            names=Names(config.namespace),
            instance=config.instance or new_instance_id(),
            model=facts.model,
            policy=config.policy,
            counters=Counters(),
            errors=collections.Counter(),
        )
        self.instance, self.model, self.counters = ctx.instance, ctx.model, ctx.counters
        self.running = running = RunningRequests(nc)
        self.lifecycle = lifecycle = Lifecycle(running)
        self.slots = slots = Slots(
            config.slots if config.slots > 0 else (facts.max_num_seqs or 64) * len(facts.dp_ranks)
        )
        shard_lines = shard_room(slots.total) if role_cls.takes_shards else 0  # 0: no shards
        self.tasks = tasks = JobTasks()
        # The one cycle: pulling delivers jobs, and a job handed back waits until pulling stopped.
        self.pulls = pulls = Pulls(
            nc,
            ctx.names.jobs_stream,
            free_slots=slots.free,
            on_job=lambda msg: on_job(msg),
            expires=config.pull_expires,
            tasks=tasks,
        )
        slots.listen(pulls.wake)
        self.log = request_log = RequestLog(nc, ctx.names)
        self.dead_letters = dead_letters = DeadLetters(ctx, role_cls.queue)
        self.exhausted = exhausted = Exhausted(ctx, request_log, dead_letters)
        self.adapter_queues = adapter_queues = AdapterQueues(
            ctx, role_cls.queue, pulls, on_exhausted=exhausted.on_advisory
        )
        self.directed = directed = DirectedQueue(
            ctx, role_cls.queue, pulls, running, on_exhausted=exhausted.on_advisory
        )
        self.sweeper = Sweeper(ctx, directed, interval=config.registry_interval, paused=lambda: slots.paused)
        self.kv_events = kv_events = KvEventRelay(ctx, facts.kv_events, lifecycle.public)
        if role_cls.follows_cache:
            kv_events.follower = CachedBlocks.for_engine(facts)
        self.reports = reports = Reports(
            ctx,
            role=role_cls.name,
            queue=role_cls.queue,
            shard_lines=shard_lines,
            engine=engine,
            lifecycle=lifecycle,
            slots=slots,
            running=running,
            kv_events=kv_events,
            registry_interval=config.registry_interval,
        )

        def adapters_changed(loaded: list[str]) -> None:
            reports.adapters = loaded
            registry.beat_now()
            tasks.spawn(adapter_queues.sync, list(loaded))

        self.lora = lora = LoraManager(
            ctx,
            engine,
            config.lora,
            retire_wait=config.grace_period,
            spawn=tasks.spawn,
            on_change=adapters_changed,
        )
        self.role = role_cls(
            RoleDeps(
                ctx=ctx,
                engine=engine,
                log=request_log,
                config=config,
                adapters=lora,
                serves_adapter=adapter_queues.serves,
                embeds=EmbedsLoader(ctx.js, ctx.names, facts, config.max_embeds_bytes),
                cached_blocks=kv_events.follower,
            )
        )
        self.registry = registry = RegistryKeeper(
            nc,
            ctx.names,
            reports.instance_record,
            self.role.model_card,
            reports.load_reports,
            interval=config.registry_interval,
            replicas=config.policy.replicas,
        )
        self.batcher = FrameBatcher(nc)
        self.jobs = jobs = JobDeps(
            ctx=ctx,
            role=self.role,
            running=running,
            log=request_log,
            dead_letters=dead_letters,
            traces=TracePublisher(nc, ctx.names),
            tasks=tasks,
            pulls=pulls,
            lifecycle=lifecycle,
            checkpoint_interval=config.checkpoint_interval,
            detached_checkpoint_interval=config.detached_checkpoint_interval,
            batcher=self.batcher,
        )
        on_job = intake(jobs, slots)
        self._shard_lines = shard_lines
        self._on_shard = shard_intake(jobs, slots)
        self.engine_control = EngineControl(
            engine,
            instance=ctx.instance,
            lifecycle=lifecycle,
            slots=slots,
            pulls=pulls,
            hand_back=running.hand_back_remaining,
            canary=self.role.canary,
            on_state_change=registry.beat_now,
            on_cache_cleared=kv_events.engine_cleared,
            health_interval=config.health_interval,
            health_timeout=config.health_timeout,
            grace_period=config.grace_period,
        )
        self.control = ControlServer(nc, ctx.names, ctx.instance, ctx.model)
        for verb, handler, request in self._verbs():
            self.control.add(verb, handler, request=request)
        self.served_at: float | None = None

    # the one place where verbs, subscriptions and services are listed

    def _verbs(self) -> list[Verb]:
        ec, lora = self.engine_control, self.lora
        return [
            ("health", ec.health, HealthCheck),
            ("reset-prefix-cache", ec.reset_prefix_cache, None),
            ("sleep", ec.sleep, SleepRequest),
            ("wake", ec.wake, None),
            ("lora-load", lora.on_load, LoraLoad),
            ("lora-unload", lora.on_unload, LoraUnload),
            ("lora-list", lora.on_list, None),
            ("kv-resync", self.kv_events.resync_verb, None),
            ("tasks", self._tasks, None),
        ]

    async def _tasks(self, _: None) -> TasksReport:
        """What SIGUSR1 writes to the log, asked over NATS (admin only: it names running requests)."""
        tasks = [TaskWait(name=name, awaits=chain) for name, chain in taskdump.all_tasks()]
        return TasksReport(instance=self.instance, tasks=tasks)

    def _subscriptions(self) -> dict[str, Callable[[Msg], Awaitable[None]]]:
        names, instance = self.ctx.names, self.instance
        status = functools.partial(answer_status, self.nc, self.reports)
        return {
            names.cancel_all: self.running.on_cancel,
            names.control("status"): status,
            names.instance_control(instance, "status"): status,
            names.instance_control(instance, "ping"): self.running.on_ping,
            names.max_deliveries_advisory(self.role.queue, self.model): self.exhausted.on_advisory,
            **(
                {names.max_deliveries_advisory(SHARD_QUEUE, self.model): self.exhausted.on_advisory}
                if self._shard_lines
                else {}
            ),
        }

    def _services(self) -> list[tuple[str, Callable[..., Awaitable[Any]], tuple[Any, ...]]]:
        """Long-lived companions, started once the engine answered; each restarts after a failure."""
        config = self.config
        services: list[tuple[str, Callable[..., Awaitable[Any]], tuple[Any, ...]]] = [
            ("engine monitor", self.engine_control.monitor, ()),
            ("heartbeats", self.running.tick, (config.heartbeat_interval, config.policy.ack_wait)),
            ("log resync", resync_after_reconnects, (self.nc, self.log, self.instance, self.running)),
            ("frame batches", self.batcher.run, ()),
            ("directed jobs", self.sweeper.run, ()),
        ]
        if self.lora.enabled:
            services.append(("LoraManager.watch", self.lora.watch, ()))
        if self.kv_events.enabled:
            services.append(("KvEventRelay.run", self.kv_events.run, ()))
        return services

    # lifecycle

    @property
    def state(self) -> WorkerState:
        return self.lifecycle.state

    @property
    def exit_code(self) -> int:
        return self.lifecycle.exit_code

    @exit_code.setter
    def exit_code(self, code: int) -> None:
        self.lifecycle.exit_code = code

    async def serve(self, *, handle_signals: bool = True) -> int:
        """Run until stopped (signal, `stop()`, or engine death); returns the process exit code."""
        ctx, config, lifecycle = self.ctx, self.config, self.lifecycle
        await ensure_streams(ctx.js, ctx.names, ctx.policy)
        if config.metrics_port is not None:
            from .metrics import PlaneCollector, serve_metrics

            collector = PlaneCollector(ctx, self.slots, lifecycle, self.kv_events)
            self.reports.metrics_url = serve_metrics(collector, config.metrics_port)
        consumer = await ensure_consumer(ctx.js, ctx.names, self.role.queue, self.model, ctx.policy)
        shards = None
        if self._shard_lines:
            shards = await ensure_consumer(ctx.js, ctx.names, SHARD_QUEUE, self.model, ctx.policy)
        await self.directed.open()
        subscriptions = self._subscriptions()
        async with checked(self.nc, "subscribe", *subscriptions):  # a refused one fails the start
            subs = [
                await self.nc.subscribe(subject, cb=functools.partial(contained, f"handler of {subject}", cb))
                for subject, cb in subscriptions.items()
            ]
        log.info(
            "worker %s serving %r (role %s, %d slots) from consumer %s",
            self.instance,
            self.model,
            self.role.name,
            self.slots.total,
            consumer,
        )
        try:
            async with task_group() as tg:
                if handle_signals:
                    tg.start_soon(self._watch_signals)
                with fail_after(config.health_timeout):
                    await self.engine.check_health()  # ready means the engine answered, too
                for name, service, args in self._services():
                    tg.start_soon(supervised, name, service, *args)
                await self.control.start(tg)
                async with task_group() as jobs:
                    self.tasks.open(jobs)
                    self.directed.start()
                    self.pulls.start(consumer)
                    if shards is not None:
                        self.pulls.start_shards(shards, self.slots, on_shard=self._on_shard)
                    jobs.start_soon(
                        contained, "adapter queues", self.adapter_queues.sync, list(self.reports.adapters)
                    )
                    await self.registry.announce(state="serving", ready=True)
                    lifecycle.advance("served")
                    self.served_at = time.time()
                    tg.start_soon(supervised, "registry", self.registry.run)
                    await lifecycle.stop_requested.wait()
                    await self._wind_down()
                    # Only housekeeping may remain (pullers closing, log writes); it cannot hang a stop.
                    jobs.cancel_scope.deadline = anyio.current_time() + STOP_LEFTOVERS_TIMEOUT
                if jobs.cancel_scope.cancelled_caught:
                    log.error(
                        "tasks still running %.0fs after the drain were cancelled", STOP_LEFTOVERS_TIMEOUT
                    )
                self.tasks.close()
                await self.control.stop()  # before the group closes: no verb may start in a closed group
                tg.cancel_scope.cancel()
        except Exception as exc:
            if self.served_at is None:
                raise  # never served: the caller reports a failed start
            # Every job, verb and companion has its own barrier, so this is a bug in the runtime.
            lifecycle.exit_code = EXIT_CRASHED
            lifecycle.stop_reason = (
                f"crashed after serving {time.time() - self.served_at:.0f}s: {describe(exc)}"
            )
            log.critical("worker %s %s", self.instance, lifecycle.stop_reason, exc_info=exc)
        finally:
            with anyio.CancelScope(shield=True):
                await self.control.stop()
                await self.directed.hand_on()  # pulling stopped, jobs settled: none can come back here
                await self.registry.remove(self.instance)
                for sub in subs:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                with contextlib.suppress(Exception):
                    await self.nc.flush(timeout=5)
        lifecycle.advance("stopped")
        log.log(
            logging.INFO if lifecycle.exit_code == EXIT_OK else logging.ERROR,
            "worker %s stopped (%s), exit code %d",
            self.instance,
            lifecycle.stop_reason,
            lifecycle.exit_code,
        )
        return lifecycle.exit_code

    def stop(self, reason: str = "stop requested") -> None:
        """Begin a graceful stop: no more pulls, running requests get the grace period."""
        self.lifecycle.stop(reason)

    async def _wind_down(self) -> None:
        self.pulls.stop()
        if self.lifecycle.engine_dead:
            self.running.hand_back_all()
            return
        self.lifecycle.advance("drain")
        self.registry.beat_now()
        log.info("draining: %d running, grace %.1fs", len(self.running), self.config.grace_period)
        await self.slots.wait_idle(self.config.grace_period, self.running.hand_back_remaining)

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if not self.lifecycle.stop_requested.is_set():
                    log.info("%s: stopping gracefully", signal.Signals(signum).name)
                    self.stop(f"{signal.Signals(signum).name}: drained")
                else:
                    log.info("%s again: handing back running jobs now", signal.Signals(signum).name)
                    self.running.hand_back_all()

    def status(self) -> WorkerStatus:
        return self.reports.status()
