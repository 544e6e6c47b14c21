"""One job's way through a worker: decode, look up its history, claim, run, settle.

The engine starts on the prompt while the request log is read (earlystart.py); the log leads
every frame (a claim before `accepted`, a step before each token frame, the result before the
ack), so any other worker can take over from what the log says. A job that cannot be served is
dead-lettered with a typed error to its producer; one that is interrupted (cancel, drain, a dead
engine) is settled here: cancelled jobs are terminated with their result stored, the others
handed back to migrate.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from nats.aio.msg import Msg

from ..errors import EngineDead, EngineRequestError, RequestRejected
from ..schemas import CancelRequest, Claim, EmbedsPrompt, ErrorCode, GenerateRequest, Handoff, Result
from ..subjects import codec
from .earlystart import EarlyStart
from .engine import EnginePrompt
from .frames import FrameSink
from .jobs import Job, RejectedJob, decode_request
from .requestlog import History, LogUnavailable, analyze
from .roles import Outcome
from .running import Running, runs_it
from .tracing import Hop, outcome_of

if TYPE_CHECKING:
    from .runtime import Worker

log = logging.getLogger(__name__)


class JobRunner:
    def __init__(self, worker: Worker) -> None:
        self.w = worker

    async def run(self, msg: Msg) -> None:
        """One delivery, behind the fault barrier: whatever goes wrong fails this job only."""
        w = self.w
        job = Job(msg)
        frames: FrameSink | None = None
        request_id: str | None = None
        try:
            hop = Hop(msg)
            try:
                req, encoding = decode_request(msg.data, msg.headers)
            except RejectedJob as exc:
                frames = FrameSink(w.nc, exc.reply_to, exc.encoding, exc.request_id or "", attempt=job.attempt,
                                   headers=hop.header)
                await w.dead_letters.reject(job, frames, exc, exc.request_id)
                return
            request_id = req.request_id
            if req.model != w.model and req.adapter is None and w.adapter_queues.serves(req.model):
                req = msgspec.structs.replace(req, model=w.model, adapter=req.model)  # from the adapter's queue
            if req.request_id in w._running:
                # A second job with this id while the first runs here: let the first finish.
                log.warning("request %s delivered again while running here; holding the copy", req.request_id)
                w.counters["duplicates"] += 1
                await job.nak(delay=w.config.policy.ack_wait)
                return
            frames = FrameSink(
                w.nc, req.reply_to, encoding, req.request_id,
                attempt=job.attempt, log_subject=w.names.request_log(req.request_id), headers=hop.header,
            )
            await self._serve(job, req, frames)
            w._spawn(w.traces.publish, hop.record(
                request_id=req.request_id, instance=w.instance, model=w.model, attempt=frames.attempt,
                frames=frames, outcome=outcome_of(frames, job.settled_how),
            ))
        except Exception as exc:
            await w.dead_letters.fail(job, frames, exc, request_id)

    # C901: a job's whole run in one place, with one except per way it can end
    async def _serve(self, job: Job, req: GenerateRequest, frames: FrameSink) -> None:  # noqa: C901
        w = self.w
        rid = req.request_id
        run = Running(job, frames)
        w._running[rid] = run
        assert w._jobs_tg is not None
        early: EarlyStart[Outcome] = EarlyStart(
            w._jobs_tg.start_soon, frames, lambda prompt: self._generate(req, frames, prompt, History())
        )
        try:
            with run.scope:
                job.stage = "reading its request log and rendering its prompt"
                history, prompt_ids = await self._prepare(req, early)
                if history.result is not None:
                    job.stage = "answering from its stored result"
                    await self._replay_result(job, frames, history.result)
                    return
                if history.cancelled is not None:
                    run.cancel_reason = history.cancelled.reason or "cancelled before it started"
                    return
                owner = history.owner
                if owner not in (None, w.instance) and await runs_it(w.nc, w.names, owner, rid):
                    # Redelivered while its worker still runs it (a restored broker does this):
                    # leave it there; that worker's ack settles this delivery too.
                    log.info("request %s still runs on %s; leaving it there", rid, owner)
                    w.counters["deferred"] += 1
                    await job.nak(delay=w.config.policy.ack_wait)
                    return
                budget = w.config.max_migrations if req.max_migrations is None else req.max_migrations
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
                    await w.nc.publish(
                        w.names.cancel(rid),
                        codec.encode(CancelRequest(request_id=rid, reason="superseded", below_attempt=job.attempt)),
                    )
                job.stage = "claiming it in the request log"
                await w.log.write(rid, Claim(attempt=job.attempt, worker=w.instance, at=time.time()))
                job.stage = "sending its accepted frame and earlier tokens"
                if history.frames:
                    w.counters["resumed"] += 1
                    log.info("request %s: continuing after %d delivered tokens (delivery %d)",
                             rid, sum(len(f.token_ids) for f in history.frames), job.attempt)
                    await frames.replay(history.frames)
                frames.seq = history.last_seq
                await frames.accepted(
                    w.instance, w.model, job_ack=job.msg.reply,
                    resumed_tokens=sum(len(f.token_ids) for f in history.frames if f.index == 0),
                )
                job.stage = "running it on the engine"
                if early.started:
                    outcome = await early.outcome()
                else:
                    outcome = await self._generate(req, frames, prompt_ids, history)
                final = frames.final_frame(outcome.choices, outcome.usage)
                run.ended = True
                job.stage = "storing its result"
                await w.log.store_result(rid, Result(
                    attempt=job.attempt, final=final, token_ids=outcome.token_ids, text=outcome.text,
                    worker=w.instance, migrations=history.deaths + history.handoffs,
                ))
                job.stage = "sending its final frame"
                await frames.send(final)
                await job.ack()
                w.counters["acked"] += 1
                w.counters["completed"] += 1
                w._spawn(w.log.compact, rid)
        except LogUnavailable as exc:
            log.warning("request %s waits: %s", rid, exc)
            w.counters["deferred"] += 1
            with anyio.CancelScope(shield=True):
                await job.nak(delay=1.0)
        except (RequestRejected, EngineRequestError) as exc:
            await w.dead_letters.reject(job, frames, exc, rid)
        except EngineDead as exc:
            run.hand_back = True
            w._on_engine_dead(str(exc))
        finally:
            with anyio.CancelScope(shield=True):
                await early.close()
            w._running.pop(rid, None)
            w.counters["frames_sent"] += frames.frames_sent
            with anyio.CancelScope(shield=True):
                await self._settle_interrupted(job, run, rid)

    async def _generate(self, req: GenerateRequest, frames: FrameSink, prompt: EnginePrompt, history: History) -> Outcome:
        w = self.w
        async with w.lora.use(req) as adapter:
            return await w.role.run(req, frames, prompt, history, adapter)

    async def _prepare(self, req: GenerateRequest, early: EarlyStart[Outcome]) -> tuple[History, EnginePrompt]:
        """The request's history and its rendered prompt, looked up side by side.

        The engine starts on the prompt at once (see earlystart.py) unless the log already
        showed the request is not fresh.
        """
        w = self.w
        w.role.check_model(req)
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
            tg.start_soon(fetch, "last", lambda: w.log.last(req.request_id))
            if isinstance(prompt, EmbedsPrompt):
                tg.start_soon(fetch, "prompt", lambda: w.embeds.load(prompt))
            else:
                tg.start_soon(fetch, "prompt", lambda: w.engine.render(prompt))
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
            history = await w.log.history(req.request_id)
        if isinstance(got["prompt"], Exception):
            if history.result is not None or history.cancelled is not None:
                return history, []  # it ended: its prompt (an expired embeddings object, say) is not needed
            raise got["prompt"]
        return history, got["prompt"]

    async def _replay_result(self, job: Job, frames: FrameSink, result: Result) -> None:
        """The request already finished (this is a redelivery or a resubmission): answer from its result."""
        w = self.w
        log.info("request %s already finished; answering from its stored result", frames.request_id)
        await frames.replay_result(result, w.instance, w.model, job_ack=job.msg.reply)
        await job.ack()
        w.counters["acked"] += 1

    async def _settle_interrupted(self, job: Job, run: Running, rid: str) -> None:
        w = self.w
        if job.settled or run.superseded:
            if run.superseded:
                w.counters["superseded"] += 1  # the job belongs to a newer delivery now
            return
        # Counted before the awaits below: a status reader never sees the request gone but uncounted.
        if run.hand_back:
            w.counters["handed_back"] += 1
            await w._pulling_stopped()
            if not w._engine_dead:  # a planned move; an engine death counts against the budget
                try:
                    await w.log.write(rid, Handoff(attempt=job.attempt, reason="worker draining"))
                except Exception:  # the next worker then counts a death against the budget; still moves
                    log.exception("request %s: hand-off not recorded", rid)
            await job.nak()
        elif run.cancel_reason is not None:
            w.counters["cancelled"] += 1
            err = run.frames.error_frame(ErrorCode.CANCELLED, run.cancel_reason)
            try:
                await w.log.store_result(rid, Result(attempt=job.attempt, error=err, worker=w.instance))
            except Exception:  # a resubmission may then run again; the producer still hears it ended
                log.exception("request %s: cancelled result not stored", rid)
            await run.frames.send(err)
            await job.term()
