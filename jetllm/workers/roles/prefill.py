"""The prefill role: compute a prompt's KV cache and hand its blocks to the decode worker that asked.

A prefill job is the decode worker's, not a producer's: it waits for the one answer now, keeps
no log, and computes the prompt itself when the answer does not come. So this role stores
nothing, migrates nothing and refuses a job whose `expires_at` has passed (its decode worker
stopped waiting). The engine runs the prompt for one token with the connector saving the
prompt's full blocks to a block file; the file goes onto the block stream, the answer says
where and with which checksums, and the file is removed whatever happens. With one of vLLM's own
connectors (`--kv-connector`) the engines' connectors move the blocks, and the answer only names
the connector and passes on what the prefill engine's connector returned.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, ClassVar

import nats.js.errors

from ...errors import EngineRequestError, RequestRejected
from ...kvtransfer import blockfile
from ...kvtransfer.params import CHECKSUM, JETLLM_CONNECTOR, REMOTE_DECODE, SAVE, full_block_tokens
from ...kvtransfer.transport import TransferFailed, publish_blocks
from ...schemas import (
    ErrorCode,
    GenerateRequest,
    HealthCheck,
    KvBlocksHeader,
    Prefilled,
    PrefillRequest,
    SamplingOptions,
    StopConditions,
)
from ...subjects import codec
from ...subjects.setup import ensure_kv_blocks_stream
from ..jobs import decode_request
from .base import Canary, JobHandle, Role, RoleDeps
from .generate import GenerateRole

log = logging.getLogger(__name__)

DISAGG_FLAGS = frozenset({"--kv-ttl", "--kv-store-bytes", "--kv-connector", "--kv-connector-config"})
"""Flags of both sides of a disaggregated fleet."""


def block_dir(deps: RoleDeps) -> Path:
    d = deps.config.disagg.block_dir
    if not d:
        raise ValueError("the prefill and decode roles need the engine's KV connector (disagg.block_dir)")
    return Path(d)


class PrefillRole(Role):
    name = "prefill"
    queue = "prefill"
    flags: ClassVar[frozenset[str]] = DISAGG_FLAGS

    def __init__(self, deps: RoleDeps) -> None:
        super().__init__(deps)
        self._ctx = deps.ctx
        self._engine = deps.engine
        self._dir = block_dir(deps)
        self._settings = deps.config.disagg
        self._store_ready = False
        self._generate = GenerateRole(deps)  # the canary is the same short generation

    def decode(self, data: bytes, headers: dict[str, str] | None) -> tuple[PrefillRequest, codec.Encoding]:
        req, encoding = decode_request(data, headers, codec.prefill_decoder)
        return req, encoding

    async def run(self, job: JobHandle) -> None:
        req: PrefillRequest = job.request
        if req.model != self.facts.model:
            raise RequestRejected(
                ErrorCode.MODEL_NOT_SERVED,
                f"this worker serves {self.facts.model!r}, not {req.model!r}",
                field="$.model",
            )
        if req.expires_at < time.time():
            raise RequestRejected(
                ErrorCode.EXPIRED, "the prefill job expired before a worker took it", field="$.expires_at"
            )
        if req.adapter is not None:
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, "prefill workers run no adapters yet", field="$.adapter"
            )
        block = self.facts.block_size or 0
        if not block or not full_block_tokens(len(req.prompt.token_ids), block):
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST,
                f"a prompt of {len(req.prompt.token_ids)} tokens fills no {block}-token block",
                field="$.prompt.token_ids",
            )
        if self._settings.connector != JETLLM_CONNECTOR:
            await self._hand_over(req, job, full_block_tokens(len(req.prompt.token_ids), block))
            return
        if req.stored and not self._store_ready:
            job.stage = "preparing the KV block store"
            s = self._settings
            try:
                await ensure_kv_blocks_stream(
                    self._ctx.js, self._ctx.names, ttl=s.kv_ttl, max_bytes=s.kv_store_bytes
                )
            except nats.js.errors.APIError as exc:
                raise RequestRejected(
                    ErrorCode.KV_TRANSFER_FAILED,
                    f"the KV block store ({s.kv_store_bytes:,} bytes in memory) cannot be created: "
                    f"{exc.description}; lower --kv-store-bytes or raise the server's max_memory_store",
                ) from None
            self._store_ready = True
        await job.accept()
        name = f"{req.transfer_id}.kv"
        path = self._dir / name
        try:
            job.stage = "prefilling its prompt on the engine"
            started = time.monotonic()
            await self._prefill(req, {SAVE: name, CHECKSUM: req.checksum})
            if not path.exists():
                raise EngineRequestError("the engine's KV connector wrote no blocks for this prompt")
            prefill_ms = (time.monotonic() - started) * 1000
            job.stage = "publishing its KV blocks"
            started = time.monotonic()
            try:
                pub = await publish_blocks(
                    self._ctx.nc,
                    self._ctx.names,
                    req.transfer_id,
                    path,
                    packed=req.packed,
                    checksum=req.checksum,
                    window=req.window,
                    stored=req.stored,
                )
            except TransferFailed as exc:
                raise RequestRejected(ErrorCode.KV_TRANSFER_FAILED, str(exc)) from None
            publish_ms = (time.monotonic() - started) * 1000
        finally:
            blockfile.remove(path)
        log.info(
            "prefill %s: %d tokens in %d blocks (%.1f MB) prefilled in %.0f ms, published in %.0f ms",
            req.request_id,
            pub.header.num_tokens,
            pub.header.num_blocks,
            pub.bytes / 1e6,
            prefill_ms,
            publish_ms,
        )
        await job.reply(
            Prefilled(
                request_id=req.request_id,
                transfer_id=req.transfer_id,
                worker=self._ctx.instance,
                header=pub.header,
                checksums=pub.checksums,
                chunk_bytes=pub.chunk_bytes,
                blocks_per_message=pub.blocks_per_message,
                messages=pub.messages,
                expires_at=time.time() + self._settings.kv_ttl,
                prefill_ms=prefill_ms,
                publish_ms=publish_ms,
            ),
            "prefilled",
        )

    async def _hand_over(self, req: PrefillRequest, job: JobHandle, covered: int) -> None:
        """With one of vLLM's own connectors: the connectors move the blocks, the answer says which
        one did and passes on what the prefill engine's connector returned for the decode engine."""
        await job.accept()
        job.stage = "prefilling its prompt on the engine"
        started = time.monotonic()
        kv_params = await self._prefill(req, dict(REMOTE_DECODE))
        block = self.facts.block_size or 1
        await job.reply(
            Prefilled(
                request_id=req.request_id,
                transfer_id=req.transfer_id,
                worker=self._ctx.instance,
                header=KvBlocksHeader(
                    block_size=block,
                    num_tokens=covered,
                    num_blocks=covered // block,
                    block_bytes=0,
                    prompt_digest=blockfile.prompt_digest(req.prompt.token_ids[:covered]),
                    layers=[],
                ),
                checksums=[],
                chunk_bytes=0,
                messages=0,
                expires_at=time.time() + self._settings.kv_ttl,
                prefill_ms=(time.monotonic() - started) * 1000,
                connector=self._settings.connector,
                kv_params=kv_params,
            ),
            "prefilled",
        )

    async def _prefill(self, req: PrefillRequest, kv: dict[str, Any]) -> dict[str, Any] | None:
        """Run the prompt for one token; returns what the engine's connector said for the decode
        engine (vLLM's connectors), if anything."""
        one = GenerateRequest(
            request_id=req.request_id,
            model=req.model,
            prompt=req.prompt,
            sampling=SamplingOptions(temperature=0.0),
            stop=StopConditions(max_tokens=1, ignore_eos=True),
        )
        steps: Any = self._engine.generate(one, list(req.prompt.token_ids), 1, None, kv)
        kv_params = None
        async for step in steps:
            kv_params = step.kv_params or kv_params
        return kv_params

    async def canary(self, check: HealthCheck) -> Canary:
        return await self._generate.canary(check)
