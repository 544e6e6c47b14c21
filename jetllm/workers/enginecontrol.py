"""Control verbs that act on the engine: health (with a canary generation), clearing the prefix
cache, sleep and wake; and the periodic health check, which judges the engine the same way.

Sleep has no half-states: the worker stops pulling, lets running requests finish (those still
running after the grace period are handed back and migrate), then pauses the engine; only then
does it report `sleeping`. A failure on the way puts it back to serving and says why.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import EngineDead
from ..schemas import (
    ControlDone,
    ErrorCode,
    GenerateRequest,
    HealthCheck,
    HealthReport,
    SamplingOptions,
    SleepRequest,
    StopConditions,
    TokensPrompt,
)
from ..subjects import codec
from .control import ControlError

if TYPE_CHECKING:
    from .runtime import Worker

log = logging.getLogger(__name__)

_health_check = codec.Decoder(HealthCheck)


_sleep = codec.Decoder(SleepRequest)


class EngineControl:
    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self.last_error: str | None = None
        self._lock = anyio.Lock()
        self._canaries = 0
        worker.control.add("health", self.health)
        worker.control.add("reset-prefix-cache", self.reset_prefix_cache)
        worker.control.add("sleep", self.sleep)
        worker.control.add("wake", self.wake)

    async def monitor(self) -> None:
        """The periodic check: a dead or hung engine stops the worker, which hands every job back."""
        w = self.w
        while True:
            await anyio.sleep(w.config.health_interval)
            try:
                with anyio.fail_after(w.config.health_timeout):
                    await w.engine.check_health()
            except (EngineDead, TimeoutError) as exc:
                w._on_engine_dead(str(exc) or "health check timed out")
                return

    async def health(self, body: bytes, encoding: Any) -> HealthReport:
        check = _health_check.decode(body, encoding) if body else HealthCheck()
        w = self.w
        report = HealthReport(instance=w.instance, healthy=False, engine_alive=False, state=w.public_state(),
                              checked_at=time.time())
        try:
            with anyio.fail_after(w.config.health_timeout):
                await w.engine.check_health()
            report.engine_alive = True
        except (EngineDead, TimeoutError) as exc:
            self.last_error = str(exc) or "engine health check timed out"
        if report.engine_alive and check.canary and not w.sleeping:
            report.canary_ok, report.canary_tokens, report.canary_latency_ms = await self._canary(check)
        report.healthy = report.engine_alive and report.canary_ok is not False
        report.last_error = self.last_error
        return report

    async def _canary(self, check: HealthCheck) -> tuple[bool, int, float]:
        """A short greedy generation; fails when the stream stalls for `stall_timeout`."""
        self._canaries += 1
        req = GenerateRequest(
            request_id=f"health-{self.w.instance}-{self._canaries}",
            model=self.w.model,
            prompt=TokensPrompt(token_ids=[1, 2, 3, 4]),
            sampling=SamplingOptions(temperature=0.0),
            stop=StopConditions(max_tokens=max(1, min(check.max_tokens, 16)), ignore_eos=True),
        )
        started = time.monotonic()
        tokens = 0
        try:
            steps = self.w.engine.generate(req, [1, 2, 3, 4], req.stop.max_tokens or 1)
            while True:
                with anyio.fail_after(check.stall_timeout):
                    try:
                        step = await steps.__anext__()
                    except StopAsyncIteration:
                        break
                tokens += sum(len(c.token_ids) for c in step.choices)
        except TimeoutError:
            self.last_error = f"canary stalled: no token for {check.stall_timeout:.1f}s after {tokens} tokens"
            await steps.aclose()
            return False, tokens, (time.monotonic() - started) * 1000
        except Exception as exc:
            self.last_error = f"canary failed: {type(exc).__name__}: {exc}"
            return False, tokens, (time.monotonic() - started) * 1000
        ok = tokens == req.stop.max_tokens
        if not ok:
            self.last_error = f"canary produced {tokens} of {req.stop.max_tokens} tokens"
        return ok, tokens, (time.monotonic() - started) * 1000

    async def reset_prefix_cache(self, body: bytes, encoding: Any) -> ControlDone:
        if not await self.w.engine.reset_prefix_cache():
            raise ControlError(ErrorCode.CONFLICT, "the engine kept its prefix cache: blocks are still in use "
                                                    "by running requests; try again when idle")
        self.w.kv_events.engine_cleared()
        return ControlDone(instance=self.w.instance, verb="reset-prefix-cache", detail="prefix cache cleared",
                           state=self.w.public_state())

    async def sleep(self, body: bytes, encoding: Any) -> ControlDone:
        level = (_sleep.decode(body, encoding) if body else SleepRequest()).level
        if level not in (1, 2):
            raise ControlError(ErrorCode.INVALID_REQUEST, f"sleep level must be 1 or 2, got {level}")
        w = self.w
        async with self._lock:
            if w.sleeping:
                return ControlDone(instance=w.instance, verb="sleep", detail="already asleep", state="sleeping")
            if w.state != "serving":
                raise ControlError(ErrorCode.CONFLICT, f"cannot sleep while {w.state}")
            w.pause_pulling(True)
            try:
                await w.credit_returned()  # a job sent now would wait for ack_wait on a sleeping worker
                await w.wait_idle(hand_back_after=w.config.grace_period)
                detail = await w.engine.sleep(level)
            except BaseException as exc:
                w.pause_pulling(False)
                if isinstance(exc, Exception):
                    raise ControlError(ErrorCode.ENGINE_ERROR, f"sleep failed, still serving: {exc}") from None
                raise
            w.sleeping = True
            w.registry.beat_now()
            log.info("asleep: %s", detail)
            return ControlDone(instance=w.instance, verb="sleep", detail=detail, state="sleeping")

    async def wake(self, body: bytes, encoding: Any) -> ControlDone:
        w = self.w
        async with self._lock:
            if not w.sleeping:
                return ControlDone(instance=w.instance, verb="wake", detail="already awake", state=w.public_state())
            try:
                await w.engine.wake()
            except Exception as exc:
                raise ControlError(ErrorCode.ENGINE_ERROR, f"wake failed, still asleep: {exc}") from None
            w.sleeping = False
            w.pause_pulling(False)
            w.registry.beat_now()
            log.info("awake: pulling jobs again")
            return ControlDone(instance=w.instance, verb="wake", detail="serving again", state="serving")
