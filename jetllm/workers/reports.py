"""What a worker says about itself, built from its parts when asked: the registry record and load
reports (rewritten every beat, for routers and `jetllm status`) and the status reply (built only on
request, so it can carry the whole picture: the requests running here, the engine's load, every
counter; tests and the demo wait for workers and read their counters with it)."""

from __future__ import annotations

import os
import socket
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from .. import __version__
from ..schemas import EngineInfo, InstanceRecord, LoadReport, WorkerStatus
from ..subjects import codec
from .context import WorkerContext
from .control import reply_encoding
from .engine import Engine
from .kvevents import KvEventRelay
from .registry import expires_after
from .running import RunningRequests
from .slots import Slots
from .state import Lifecycle


class Reports:
    def __init__(
        self,
        ctx: WorkerContext,
        *,
        role: str,
        queue: str,
        shard_lines: int = 0,
        engine: Engine,
        lifecycle: Lifecycle,
        slots: Slots,
        running: RunningRequests,
        kv_events: KvEventRelay,
        registry_interval: float,
    ) -> None:
        self._ctx = ctx
        self._role = role
        self._queue = queue
        self._shard_lines = shard_lines
        self._engine = engine
        self._lifecycle = lifecycle
        self._slots = slots
        self._running = running
        self._kv = kv_events
        self._expires_after = expires_after(registry_interval)
        self.started_at = time.time()
        self.metrics_url: str | None = None
        """Set once the metrics endpoint listens."""
        self.adapters: list[str] = []
        """LoRA adapters loaded now (requests may name them as their model)."""

    def instance_record(self) -> InstanceRecord:
        ctx, facts = self._ctx, self._engine.facts
        return InstanceRecord(
            instance=ctx.instance,
            role=self._role,
            model=ctx.model,
            state=self._lifecycle.public(),
            adapters=list(self.adapters),
            dp_ranks=list(facts.dp_ranks),
            engine=EngineInfo(
                engine=facts.engine,
                block_size=facts.block_size,
                num_kv_blocks=facts.num_kv_blocks,
                max_num_seqs=facts.max_num_seqs,
                max_model_len=facts.max_model_len,
                dp_size=len(facts.dp_ranks),
            ),
            slots=self._slots.total,
            in_flight=self._slots.busy,
            version=__version__,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self.started_at,
            heartbeat_at=time.time(),
            expires_after=self._expires_after,
            metrics_url=self.metrics_url,
            cached_blocks=self._kv.cached_blocks if self._kv.enabled else None,
            ready=self._lifecycle.ready,
            directed_queue=self._queue,
            shard_lines=self._shard_lines,
        )

    def load_reports(self) -> list[LoadReport]:
        """One report per data-parallel rank: a router balances ranks, not processes."""
        ctx, slots = self._ctx, self._slots
        now, state = time.time(), self._lifecycle.public()
        return [
            LoadReport(
                instance=ctx.instance,
                model=ctx.model,
                dp_rank=rank,
                at=now,
                running=load.running,
                waiting=load.waiting,
                in_flight=slots.busy,
                slots=slots.total,
                kv_usage=load.kv_usage,
                num_kv_blocks=self._engine.facts.num_kv_blocks,
                state=state,
            )
            for rank, load in sorted(self._engine.load_by_rank().items())
        ]

    def status(self) -> WorkerStatus:
        ctx, engine = self._ctx, self._engine
        load = engine.load()
        return WorkerStatus(
            instance=ctx.instance,
            role=self._role,
            model=ctx.model,
            state=self._lifecycle.state,
            slots=self._slots.total,
            in_flight=self._slots.busy,
            request_ids=sorted(self._running),
            engine_unfinished=load.unfinished,
            started_at=self.started_at,
            version=__version__,
            host=socket.gethostname(),
            pid=os.getpid(),
            extra={
                "engine": engine.facts.engine,
                "engine_running": str(load.running),
                "engine_waiting": str(load.waiting),
                "max_model_len": str(engine.facts.max_model_len),
                **{k: str(v) for k, v in ctx.counters.items()},
                **{f"kv_{k}": str(v) for k, v in self._kv.counters.items() if self._kv.running},
                **{f"prefill_{k}": str(v) for k, v in ctx.prefills.items()},
            },
        )


async def answer_status(nc: NATS, status: Reports, msg: Msg) -> None:
    """The status subjects' handler (model-wide and this instance's)."""
    if msg.reply:
        await nc.publish(msg.reply, codec.encode(status.status(), reply_encoding(msg)))
