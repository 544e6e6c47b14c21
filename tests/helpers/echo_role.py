"""A test-only role: the proof that adding a role does not touch the runtime.

It consumes its own queue (`jobs.echo.<model>`), decodes its own job type, never calls the
engine, and answers each job with its words as token frames, through the same job protocol as
generate (claim, accept, tokens, finish). A job saying "refuse" fails with a typed error; one
saying "boom" raises a bug the fault barrier must contain.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from jetllm.errors import RequestRejected
from jetllm.schemas import SCHEMA_VERSION, Choice, ErrorCode, HealthCheck, Usage
from jetllm.subjects import codec
from jetllm.workers.jobs import decode_request
from jetllm.workers.roles import Canary, JobHandle, Role, RoleDeps


class EchoJob(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    v: int = SCHEMA_VERSION
    request_id: str
    model: str
    text: str
    reply_to: str | None = None


_decoder = codec.Decoder(EchoJob)


class EchoRole(Role):
    name = "echo"
    queue = "echo"
    flags: ClassVar[frozenset[str]] = frozenset({"--echo-loudly"})

    def __init__(self, deps: RoleDeps) -> None:
        super().__init__(deps)
        self.canaries = 0

    def decode(self, data: bytes, headers: dict[str, str] | None) -> tuple[EchoJob, codec.Encoding]:
        return decode_request(data, headers, _decoder)

    async def run(self, job: JobHandle) -> None:
        req: EchoJob = job.request
        if req.text == "refuse":
            raise RequestRejected(ErrorCode.INVALID_REQUEST, "echo: nothing worth echoing", field="$.text")
        await job.claim()
        await job.accept()
        job.stage = "echoing"
        if req.text == "boom":
            raise RuntimeError("echo broke")
        words = req.text.split()
        for word in words:
            await job.tokens(0, [len(word)], word + " ", None, None)
        await job.finish(
            [Choice(index=0, finish_reason="stop", completion_tokens=len(words))],
            Usage(prompt_tokens=len(words), completion_tokens=len(words)),
            token_ids=[[len(w) for w in words]],
            text=[req.text],
        )

    async def canary(self, check: HealthCheck) -> Canary:
        self.canaries += 1
        return Canary(ok=True, tokens=0, ms=0.0)
