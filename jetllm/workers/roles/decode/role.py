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
            "--max-prefill-queue",
            "--prefill-timeout",
            "--kv-transfer-timeout",
        }
    )

    def __init__(self, deps: RoleDeps) -> None:
        super().__init__(deps)
        self._settings = deps.config.disagg
        self._remote = RemotePrefill(deps.ctx, deps.config.disagg, block_dir(deps))

    async def _generate(
        self, req: GenerateRequest, job: JobHandle, prompt: EnginePrompt, history: History
    ) -> Outcome:
        kv, handoff = None, None
        how = await self._where(req, prompt, history)
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

    async def _where(self, req: GenerateRequest, prompt: EnginePrompt, history: History) -> str:
        n = len(prompt)
        block = self.facts.block_size or 0
        decision = decide(
            n,
            full_block_tokens=full_block_tokens(n, block) if block else 0,
            threshold=self._settings.threshold,
            queue=await self._remote.queue(),
            max_queue=self._settings.max_prefill_queue,
            continuation=bool(history.frames),
            embeds=isinstance(prompt, PromptEmbeds),
            adapter=req.adapter is not None,
        )
        return decision.reason
