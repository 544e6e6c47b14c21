"""The aggregated role: a generate job runs prefill and decode on this worker's engine.

What is generate's own lives here: the request's history in its log (and, for the newest tokens,
its producer's word) decides whether it runs fresh, continues what a dead worker delivered, answers from its stored result, waits for a worker that
still runs it, or fails for a spent migration budget; the engine starts on the prompt while that
history is read (earlystart.py). Claiming, frames and settling are the job protocol's (the handle).
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

import anyio
import msgspec

from ....aio import fail_after, task_group
from ....errors import RequestRejected
from ....schemas import (
    EmbedsPrompt,
    ErrorCode,
    GenerateRequest,
    HealthCheck,
    OutputOptions,
    Result,
    SamplingOptions,
    StopConditions,
    TokensPrompt,
)
from ....subjects import codec
from ...engine import EnginePrompt
from ...jobs import decode_request
from ...requestlog import History, analyze, with_cancel, with_delivered
from ...running import runs_it
from ..base import Canary, JobHandle, Role, RoleDeps
from .continuation import check_budget
from .earlystart import EarlyStart
from .stream import Outcome, generate

log = logging.getLogger(__name__)


class GenerateRole(Role):
    name = "generate"
    queue = "generate"
    takes_shards = True
    flags: ClassVar[frozenset[str]] = frozenset(
        {
            "--max-migrations",
            "--max-embeds-bytes",
            "--enable-prompt-embeds",
            "--enable-lora",
            "--max-loras",
            "--max-lora-rank",
            "--lora-dir",
            "--lora-cache-dir",
            "--lora-cache-max-bytes",
            "--lora-allow-hub",
        }
    )

    def __init__(self, deps: RoleDeps) -> None:
        super().__init__(deps)
        self._ctx = deps.ctx
        self._engine = deps.engine
        self._log = deps.log
        self._adapters = deps.adapters
        self._serves_adapter = deps.serves_adapter
        self._embeds = deps.embeds
        self._max_migrations = deps.config.max_migrations
        self._canaries = 0

    def decode(self, data: bytes, headers: dict[str, str] | None) -> tuple[GenerateRequest, codec.Encoding]:
        req, encoding = decode_request(data, headers)
        model = self._ctx.model
        if req.model != model and req.adapter is None and self._serves_adapter(req.model):
            req = msgspec.structs.replace(req, model=model, adapter=req.model)  # from the adapter's queue
        return req, encoding

    def check_model(self, req: GenerateRequest) -> None:
        if req.model != self.facts.model:
            raise RequestRejected(
                ErrorCode.MODEL_NOT_SERVED,
                f"this worker serves {self.facts.model!r}, not {req.model!r}",
                field="$.model",
            )

    async def run(self, job: JobHandle) -> None:
        req: GenerateRequest = job.request
        rid = job.request_id
        early: EarlyStart[Outcome] = EarlyStart(
            job.start_soon,
            job,
            lambda prompt: self._generate(req, job, prompt, History()),
            f"job {rid}, early start",
        )
        try:
            fresh = await self._claimed_fresh(req, job) if job.fresh else None
            if fresh is not None:
                history, prompt_ids = History(), fresh
            else:
                job.stage = "reading its request log and rendering its prompt"
                # a fresh job whose claim was refused has a log: no early start on a lost bet
                history, prompt_ids = await self._prepare(req, early, bet=not job.fresh)
                if history.result is not None:
                    await job.answer_from(history.result)
                    return
                if history.cancelled is not None:
                    job.cancelled(history.cancelled.reason or "cancelled before it started")
                    return
                owner = history.owner
                if owner not in (None, self._ctx.instance) and await runs_it(
                    self._ctx.nc, self._ctx.names, owner, rid
                ):
                    # Redelivered while its worker still runs it (a restored broker does this):
                    # leave it there; that worker's ack settles this delivery too.
                    log.info("request %s still runs on %s; leaving it there", rid, owner)
                    await job.defer(self._ctx.policy.ack_wait)
                    return
                budget = self._max_migrations if req.max_migrations is None else req.max_migrations
                check_budget(history, budget, job.attempt)
                # An older attempt may still be alive (stalled, partitioned): the claim tells it to stop.
                await job.claim(above=history.last_attempt, supersede=history.claimed)
                if history.claimed:  # the newest frames an earlier attempt sent are the producer's to tell
                    history = with_delivered(history, await job.delivered(history.last_seq))
                if history.frames:
                    self._ctx.counters.resumed += 1
                    log.info(
                        "request %s: continuing after %d delivered tokens (delivery %d)",
                        rid,
                        sum(len(f.token_ids) for f in history.frames),
                        job.attempt,
                    )
            await job.accept(
                replay=history.frames,
                last_seq=history.last_seq,
                resumed_tokens=sum(len(f.token_ids) for f in history.frames if f.index == 0),
            )
            job.stage = "running it on the engine"
            if early.started:
                outcome = await early.outcome()
            else:
                outcome = await self._generate(req, job, prompt_ids, history)
            await job.finish(
                outcome.choices,
                outcome.usage,
                token_ids=outcome.token_ids,
                text=outcome.text,
                logprobs=outcome.logprobs,
                migrations=history.deaths + history.handoffs,
            )
        finally:
            with anyio.CancelScope(shield=True):
                await early.close()

    async def _generate(
        self, req: GenerateRequest, job: JobHandle, prompt: EnginePrompt, history: History
    ) -> Outcome:
        async with self._adapters.use(req) as adapter:
            self.check_model(req)
            return await generate(self._engine, req, job.tokens, prompt, history, adapter)

    async def _claimed_fresh(self, req: GenerateRequest, job: JobHandle) -> EnginePrompt | None:
        """A fresh job's rendered prompt, once its empty log is claimed; None when the log was not
        empty (or the prompt is an embeddings object, read beside the log): the usual path then
        reads it, so a job wrongly called fresh only costs that round trip."""
        if isinstance(req.prompt, EmbedsPrompt):
            return None
        self.check_model(req)
        if not await job.claim_first():
            return None
        job.stage = "rendering its prompt"
        return await self._engine.render(req.prompt)

    async def _prepare(
        self, req: GenerateRequest, early: EarlyStart[Outcome], *, bet: bool = True
    ) -> tuple[History, EnginePrompt]:
        """The request's history (its log and any durable cancel) and its rendered prompt, looked
        up side by side; `bet`: start the engine on the prompt before the log answers.

        The engine starts on the prompt at once (see earlystart.py) unless the log already
        showed the request is not fresh. A prompt is rendered and the log read in this task, the
        cancel in a task of its own: a task costs more CPU than rendering a token prompt, and the
        two lookups are still in flight together.
        """
        self.check_model(req)
        got: dict[str, Any] = {}

        async def fetch(name: str, fn: Any) -> None:
            try:
                got[name] = await fn()
            except Exception as exc:  # re-raised below, unwrapped
                got[name] = exc
                return
            if bet and name == "prompt" and got.get("last") is None and got.get("cancel") is None:
                early.start(got["prompt"])  # the log and cancels are not read yet, or empty

        prompt = req.prompt
        async with task_group() as tg:
            tg.start_soon(fetch, "cancel", lambda: self._log.cancel(req.request_id))
            if isinstance(prompt, EmbedsPrompt):  # an object store read: beside the log's
                tg.start_soon(fetch, "prompt", lambda: self._embeds.load(prompt))
            else:
                await fetch("prompt", lambda: self._engine.render(prompt))
            await fetch("last", lambda: self._log.last(req.request_id))
        last, cancel = got["last"], got["cancel"]
        if last is not None or cancel is not None:
            await early.close()
        for failed in (last, cancel):
            if isinstance(failed, Exception):
                raise failed
        if last is None:
            history = History()
        elif isinstance(last, Result):
            history = analyze([last])
        else:
            history = await self._log.history(req.request_id)
        history = with_cancel(history, cancel)
        if isinstance(got["prompt"], Exception):
            if history.result is not None or history.cancelled is not None:
                return history, []  # it ended: its prompt (an expired embeddings object, say) is not needed
            raise got["prompt"]
        return history, got["prompt"]

    async def canary(self, check: HealthCheck) -> Canary:
        """A short greedy generation; fails when the stream stalls for `stall_timeout`."""
        self._canaries += 1
        req = GenerateRequest(
            request_id=f"health-{self._ctx.instance}-{self._canaries}",
            model=self._ctx.model,
            prompt=TokensPrompt(token_ids=[1, 2, 3, 4]),
            sampling=SamplingOptions(temperature=0.0),
            stop=StopConditions(max_tokens=max(1, min(check.max_tokens, 16)), ignore_eos=True),
            output=OutputOptions(stream_interval=1),  # its stall timer counts every token
        )
        started = time.monotonic()
        tokens = 0
        try:
            steps = self._engine.generate(req, [1, 2, 3, 4], req.stop.max_tokens or 1)
            while True:
                with fail_after(check.stall_timeout):
                    try:
                        step = await steps.__anext__()
                    except StopAsyncIteration:
                        break
                tokens += sum(len(c.token_ids) for c in step.choices)
        except TimeoutError:
            await steps.aclose()
            return Canary(
                ok=False,
                tokens=tokens,
                ms=(time.monotonic() - started) * 1000,
                error=f"canary stalled: no token for {check.stall_timeout:.1f}s after {tokens} tokens",
            )
        except Exception as exc:
            return Canary(
                ok=False,
                tokens=tokens,
                ms=(time.monotonic() - started) * 1000,
                error=f"canary failed: {type(exc).__name__}: {exc}",
            )
        ok = tokens == req.stop.max_tokens
        error = None if ok else f"canary produced {tokens} of {req.stop.max_tokens} tokens"
        return Canary(ok=ok, tokens=tokens, ms=(time.monotonic() - started) * 1000, error=error)
