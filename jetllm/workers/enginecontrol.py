"""Control verbs that act on the engine: health (with the role's canary), clearing the prefix
cache, sleep and wake; and the periodic health check, which judges the engine the same way.

Sleep has no half-states: the worker stops pulling, waits until no pull credit is left (a job
sent now would wait out its ack_wait on a sleeping worker), lets running requests finish (those
still running after the grace period are handed back and migrate), then pauses the engine; only
then does it report `sleeping`. A failure on the way puts it back to serving and says why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio

from ..aio import fail_after
from ..errors import EngineDead
from ..schemas import ControlDone, ErrorCode, HealthCheck, HealthReport, SleepRequest
from .control import ControlError
from .engine import Engine
from .pulls import Pulls
from .roles import Canary
from .slots import Slots
from .state import Lifecycle

log = logging.getLogger(__name__)


class EngineControl:
    def __init__(
        self,
        engine: Engine,
        *,
        instance: str,
        lifecycle: Lifecycle,
        slots: Slots,
        pulls: Pulls,
        hand_back: Callable[[], None],
        canary: Callable[[HealthCheck], Awaitable[Canary]],
        on_state_change: Callable[[], None],
        on_cache_cleared: Callable[[], None],
        health_interval: float,
        health_timeout: float,
        grace_period: float,
    ) -> None:
        self._engine = engine
        self._instance = instance
        self._lifecycle = lifecycle
        self._slots = slots
        self._pulls = pulls
        self._hand_back = hand_back
        self._canary = canary
        self._on_state_change = on_state_change
        self._on_cache_cleared = on_cache_cleared
        self._health_interval = health_interval
        self._health_timeout = health_timeout
        self._grace_period = grace_period
        self.last_error: str | None = None
        self._lock = anyio.Lock()

    async def monitor(self) -> None:
        """The periodic check: a dead or hung engine stops the worker, which hands every job back."""
        while True:
            await anyio.sleep(self._health_interval)
            try:
                with fail_after(self._health_timeout):
                    await self._engine.check_health()
            except (EngineDead, TimeoutError) as exc:
                self._lifecycle.engine_died(str(exc) or "health check timed out")
                return

    async def health(self, check: HealthCheck) -> HealthReport:
        report = HealthReport(
            instance=self._instance,
            healthy=False,
            engine_alive=False,
            state=self._lifecycle.public(),
            checked_at=time.time(),
        )
        try:
            with fail_after(self._health_timeout):
                await self._engine.check_health()
            report.engine_alive = True
        except (EngineDead, TimeoutError) as exc:
            self.last_error = str(exc) or "engine health check timed out"
        if report.engine_alive and check.canary and self._lifecycle.state != "sleeping":
            canary = await self._canary(check)
            if canary.error is not None:
                self.last_error = canary.error
            report.canary_ok, report.canary_tokens, report.canary_latency_ms = (
                canary.ok,
                canary.tokens,
                canary.ms,
            )
        report.healthy = report.engine_alive and report.canary_ok is not False
        report.last_error = self.last_error
        return report

    async def reset_prefix_cache(self, _: None) -> ControlDone:
        if not await self._engine.reset_prefix_cache():
            raise ControlError(
                "the engine kept its prefix cache: blocks are still in use "
                "by running requests; try again when idle",
                code=ErrorCode.CONFLICT,
            )
        self._on_cache_cleared()
        return ControlDone(
            instance=self._instance,
            verb="reset-prefix-cache",
            detail="prefix cache cleared",
            state=self._lifecycle.public(),
        )

    async def sleep(self, req: SleepRequest) -> ControlDone:
        if req.level not in (1, 2):
            raise ControlError(f"sleep level must be 1 or 2, got {req.level}", code=ErrorCode.INVALID_REQUEST)
        lifecycle = self._lifecycle
        async with self._lock:
            if lifecycle.state == "sleeping":
                return ControlDone(
                    instance=self._instance, verb="sleep", detail="already asleep", state="sleeping"
                )
            if lifecycle.state != "serving":
                raise ControlError(f"cannot sleep while {lifecycle.state}", code=ErrorCode.CONFLICT)
            self._slots.pause(True)
            try:
                await (
                    self._pulls.credit_returned()
                )  # a job sent now would wait for ack_wait on a sleeping worker
                await self._slots.wait_idle(self._grace_period, self._hand_back)
                detail = await self._engine.sleep(req.level)
            except BaseException as exc:
                self._slots.pause(False)
                if isinstance(exc, Exception):
                    raise ControlError(
                        f"sleep failed, still serving: {exc}", code=ErrorCode.ENGINE_ERROR
                    ) from None
                raise
            lifecycle.advance("slept")
            self._on_state_change()
            log.info("asleep: %s", detail)
            return ControlDone(instance=self._instance, verb="sleep", detail=detail, state="sleeping")

    async def wake(self, _: None) -> ControlDone:
        lifecycle = self._lifecycle
        async with self._lock:
            if lifecycle.state != "sleeping":
                return ControlDone(
                    instance=self._instance, verb="wake", detail="already awake", state=lifecycle.public()
                )
            try:
                await self._engine.wake()
            except Exception as exc:
                raise ControlError(f"wake failed, still asleep: {exc}", code=ErrorCode.ENGINE_ERROR) from None
            lifecycle.advance("woke")
            self._slots.pause(False)
            self._on_state_change()
            log.info("awake: pulling jobs again")
            return ControlDone(instance=self._instance, verb="wake", detail="serving again", state="serving")
