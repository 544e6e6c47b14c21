"""Process entry for one worker: connect, start the engine, serve, exit with a meaningful code."""

from __future__ import annotations

import logging
import time

import anyio
from nats.aio.client import Client as NATS

from .. import taskdump
from ..subjects.connection import connect
from ..subjects.server import check_server
from .engine.options import EngineOptions
from .runtime import Worker, WorkerConfig

log = logging.getLogger(__name__)

EXIT_STARTUP_FAILED = 2


async def connect_waiting(url: str, wait: float, name: str) -> NATS:
    """Connect, trying for up to `wait` seconds: workers often start before NATS is up."""
    return await connect(url, name=name, wait=wait)


async def run_worker(
    url: str, engine_opts: EngineOptions, config: WorkerConfig, *, nats_wait: float = 60.0
) -> int:
    with taskdump.dump_on_signal():
        return await _run_worker(url, engine_opts, config, nats_wait)


async def _run_worker(url: str, engine_opts: EngineOptions, config: WorkerConfig, nats_wait: float) -> int:
    from .engine.vllm_engine import VllmEngine

    nc = await connect_waiting(url, nats_wait, name=f"jetllm-worker-{engine_opts.name}"[:64])
    try:
        await check_server(nc)
        log.info("starting vLLM engine for %s", engine_opts.model)
        started = time.monotonic()
        engine = await VllmEngine.start(engine_opts)
        log.info("engine ready in %.1fs: %s", time.monotonic() - started, engine.facts)
        try:
            return await Worker(nc, engine, config).serve()
        finally:
            with anyio.CancelScope(shield=True):
                await engine.close()
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await nc.drain()
            except Exception:
                pass
