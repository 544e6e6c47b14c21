"""The decode role: a generate worker that hands long prompts to prefill workers.

It consumes the generate queue like an aggregated worker and keeps everything generate does
(history, migration, continuation, the early start). Only where the prompt is computed differs:
for a prompt worth it (policy.py) a prefill worker computes its KV blocks, they come through
NATS into a block file, and the engine's connector loads them instead of computing them. Any
failure on that way computes the prompt here: the output is the same, the producer sees one
ordinary stream, and the trace and the metrics say what happened.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from ....kvtransfer.params import full_block_tokens
from ....schemas import GenerateRequest
from ...engine import EnginePrompt, PromptEmbeds
from ...requestlog import History
from ..base import JobHandle, RoleDeps
from ..generate import GenerateRole, Outcome
from ..generate.stream import generate
from ..prefill import DISAGG_FLAGS, block_dir
from .handoff import HandoffFailed, RemotePrefill
from .policy import decide

log = logging.getLogger(__name__)


class DecodeRole(GenerateRole):
    name = "decode"
    queue = "generate"
    flags: ClassVar[frozenset[str]] = (
        GenerateRole.flags
        | DISAGG_FLAGS
        | {
            "--disagg-threshold",
            "--disagg-cached-fraction",
            "--max-prefill-queue",
            "--prefill-timeout",
            "--kv-transfer-timeout",
            "--kv-transfer",
        }
    )

    follows_cache = True

    def __init__(self, deps: RoleDeps) -> None:
        super().__init__(deps)
        self._settings = deps.config.disagg
        self._remote = RemotePrefill(deps.ctx, deps.config.disagg, block_dir(deps))
        self._cached = deps.cached_blocks
        if self._cached is None and self._settings.cached_fraction > 0:
            log.info(
                "prompts in this engine's prefix cache may still be prefilled remotely: the engine "
                "publishes no KV-cache events to tell (start the worker without --no-kv-events)"
            )

    async def _generate(
        self, req: GenerateRequest, job: JobHandle, prompt: EnginePrompt, history: History
    ) -> Outcome:
        kv, handoff = None, None
        how, cached = await self._where(req, prompt, history)
        if how == "remote":
            assert isinstance(prompt, list)
            try:
                handoff = await self._remote.run(req.request_id, job.attempt, prompt)
                kv = handoff.kv_transfer()
                d = handoff.done
                moved = (
                    f"publish {d.publish_ms:.0f} ms, {handoff.source} blocks checked in {handoff.fetch_ms:.0f} ms"
                    if handoff.path is not None
                    else f"moved by {d.connector}"
                )
                job.prefill = (
                    f"remote on {d.worker} ({d.header.num_tokens} tokens in {d.header.num_blocks} blocks; "
                    f"prefill {d.prefill_ms:.0f} ms, {moved})"
                )
            except HandoffFailed as exc:
                how = f"local_{exc.label}"
                job.prefill = f"local: {exc}"
                log.warning("request %s: prefilling here: %s", req.request_id, exc)
        elif how == "local_cached":
            job.prefill = (
                f"local: cached ({cached} of {len(prompt)} prompt tokens in this engine's prefix cache)"
            )
        else:
            job.prefill = f"local: {how.removeprefix('local_').replace('_', ' ')}"
        self._ctx.prefills[how] += 1
        try:
            async with self._adapters.use(req) as adapter:
                self.check_model(req)
                return await generate(self._engine, req, job.tokens, prompt, history, adapter, kv)
        finally:
            if handoff is not None and handoff.path is not None:
                handoff.path.unlink(missing_ok=True)

    async def _where(self, req: GenerateRequest, prompt: EnginePrompt, history: History) -> tuple[str, int]:
        """The decision's reason, and the prompt's tokens found in the engine's prefix cache."""
        n = len(prompt)
        block = self.facts.block_size or 0
        s = self._settings
        cached = 0
        if (
            self._cached is not None
            and s.cached_fraction > 0
            and isinstance(prompt, list)  # embeddings have no block ids
            and req.adapter is None  # an adapter's blocks are keyed apart from the base model's
            and not history.frames
            and n >= s.threshold
        ):
            cached = self._cached.cached_tokens(prompt)
        decision = decide(
            n,
            full_block_tokens=full_block_tokens(n, block) if block else 0,
            threshold=s.threshold,
            queue=await self._remote.queue(),
            max_queue=s.max_prefill_queue,
            cached_tokens=cached,
            min_cached=s.cached_fraction,
            continuation=bool(history.frames),
            embeds=isinstance(prompt, PromptEmbeds),
            adapter=req.adapter is not None,
        )
        return decision.reason, cached
