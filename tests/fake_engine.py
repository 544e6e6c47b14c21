"""A light engine for fast tests of the message plane. Never a default; lives only under tests/.

It mimics the parts of vLLM the worker relies on: one step for all running requests, a context
limit, greedy-looking deterministic tokens, EOS, stop token ids, stop strings over a simple text
form, min/max tokens, n choices, log-probabilities, cancellation, and death. Token i of a request is
(sum of the context so far) % vocab.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from jetllm.errors import EngineDead, EngineRequestError, RequestRejected
from jetllm.kvtransfer import blockfile
from jetllm.kvtransfer.params import CHECKSUM, LOAD, SAVE, full_block_tokens
from jetllm.schemas import ChatPrompt, ErrorCode, GenerateRequest, Prompt, TextPrompt, TokensPrompt
from jetllm.schemas.disagg import KvBlocksHeader, KvLayer
from jetllm.workers.engine import (
    ChoiceDelta,
    EngineAdapter,
    EngineFacts,
    EngineLoad,
    EnginePrompt,
    EngineStep,
    PromptEmbeds,
)

EOS = 2


def text_of(token: int) -> str:
    return f"<{token}>"


def _finish(
    req: GenerateRequest, tok: int, text: str, produced: int, max_tokens: int
) -> tuple[str | None, int | str | None]:
    """Finish reason and stop reason after `tok`, as vLLM decides them (min_tokens holds off stops)."""
    if produced >= req.stop.min_tokens:
        if tok == EOS and not req.stop.ignore_eos:
            return "stop", None
        if tok in req.stop.stop_token_ids:
            return "stop", tok
        for s in req.stop.stop:
            if s in text:
                return "stop", s
    return ("length", None) if produced >= max_tokens else (None, None)


def _logprobs(req: GenerateRequest, tok: int, vocab: int) -> dict[str, Any]:
    """Made-up but fixed log-probabilities: the token's own, then `output.logprobs` runners-up."""
    if req.output.logprobs is None:
        return {}
    own = -(tok % 7) / 8
    top = {tok: own} | {(tok + k) % vocab: own - k for k in range(1, req.output.logprobs)}
    return {"logprobs": [own], "top_logprobs": [dict(list(top.items())[: req.output.logprobs])]}


class FakeEngine:
    def __init__(
        self,
        *,
        model: str = "fake",
        max_model_len: int = 256,
        vocab: int = 97,
        step_delay: float = 0.001,
        max_num_seqs: int = 64,
    ) -> None:
        self.facts = EngineFacts(
            model=model,
            max_model_len=max_model_len,
            vocab_size=vocab,
            max_num_seqs=max_num_seqs,
            block_size=16,
            num_kv_blocks=1024,
            engine="fake",
        )
        self.step_delay = step_delay
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.dead = False
        self.stalled = False  # True: every request freezes mid-stream
        self.started = 0
        self.fail_prompts: set[int] = set()  # a prompt starting with one of these fails in the engine
        self.adapters: dict[int, EngineAdapter] = {}
        self.ran_with: dict[str, str | None] = {}
        """Request id -> the adapter it ran with (None: the base model)."""
        self.block_dir: Path | None = None
        """Where a stand-in for jetllm's KV connector saves and loads block files (prefill/decode)."""
        self.loaded: dict[str, int] = {}
        """Request id -> prompt tokens its blocks covered, as loaded from a block file."""
        self._tick: anyio.Event | None = None

    async def render(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, TokensPrompt):
            return list(prompt.token_ids)
        if isinstance(prompt, TextPrompt):
            return [ord(c) % self.facts.vocab_size for c in prompt.text]
        if isinstance(prompt, ChatPrompt):
            text = "".join(f"[{m.role}]{m.content}" for m in prompt.messages) + "[assistant]"
            return [ord(c) % self.facts.vocab_size for c in text]
        raise RequestRejected(ErrorCode.INVALID_REQUEST, "unknown prompt")

    async def generate(
        self,
        req: GenerateRequest,
        prompt_ids: EnginePrompt,
        max_tokens: int,
        adapter: EngineAdapter | None = None,
        kv_transfer: dict[str, Any] | None = None,
    ) -> AsyncIterator[EngineStep]:
        if isinstance(prompt_ids, PromptEmbeds):  # each row stands for the token its first value rounds to
            rows = [int(abs(float(r[0]))) % self.facts.vocab_size for r in prompt_ids.array]
            prompt_ids = rows + prompt_ids.continuation
        if self.dead:
            raise EngineDead("fake engine is dead")
        self.ran_with[req.request_id] = adapter.name.split("@")[0] if adapter else None
        self._connector(req.request_id, list(prompt_ids), kv_transfer or {})
        if req.stop.min_tokens > max_tokens:
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, "min_tokens must be <= max_tokens", field="$.stop.min_tokens"
            )
        if prompt_ids and prompt_ids[0] in self.fail_prompts:
            raise EngineRequestError("fake engine failed this request")
        vocab = self.facts.vocab_size
        if any(t >= vocab for t in prompt_ids):
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, f"token id out of vocabulary ({vocab})", field="$.prompt.token_ids"
            )
        want_text = (
            req.output.text
            if req.output.text is not None
            else isinstance(req.prompt, (ChatPrompt, TextPrompt))
        )
        rid = req.request_id
        self.running.add(rid)
        self.started += 1
        n = req.sampling.n
        ctx = [list(prompt_ids) for _ in range(n)]
        texts = ["" for _ in range(n)]
        produced = [0] * n
        done = [False] * n
        try:
            while not all(done):
                while self.stalled:
                    await anyio.sleep(0.01)
                await self._step()
                if self.dead:
                    raise EngineDead("fake engine died")
                choices = []
                for i in range(n):
                    if done[i]:
                        continue
                    tok = (sum(ctx[i]) + i) % vocab
                    ctx[i].append(tok)
                    produced[i] += 1
                    piece = text_of(tok)
                    texts[i] += piece
                    finish, stop_reason = _finish(req, tok, texts[i], produced[i], max_tokens)
                    done[i] = finish is not None
                    choices.append(
                        ChoiceDelta(
                            index=i,
                            token_ids=[tok],
                            text=piece if want_text else None,
                            finish_reason=finish,
                            stop_reason=stop_reason,
                            **_logprobs(req, tok, vocab),
                        )
                    )
                yield EngineStep(choices=choices, finished=all(done))
        except BaseException:
            if not all(done):
                self.aborted.append(rid)
            raise
        finally:
            self.running.discard(rid)

    async def _step(self) -> None:
        """Every running request advances in the same step, as in vLLM, whose output handler hands
        one step's outputs to all its requests in one turn of the loop; requests sleeping on timers
        of their own drift apart on a loaded box, and a step's frames then leave in many messages
        (CI met it). The first request to wait times the step; should it be cancelled, the others
        step early and the next to wait times the one after."""
        tick = self._tick
        if tick is not None:
            await tick.wait()
            return
        tick = self._tick = anyio.Event()
        try:
            await anyio.sleep(self.step_delay)
        finally:
            self._tick = None
            tick.set()

    def _connector(self, rid: str, prompt: list[int], kv: dict[str, Any]) -> None:
        """What kvtransfer/connector.py does in vLLM, on made-up blocks: a prefill writes the
        prompt's full blocks (as many bytes per token as the tiny model's KV), a decode loads them
        when they are this prompt's."""
        if self.block_dir is None:
            return
        block = self.facts.block_size or 16
        if SAVE in kv:
            n = full_block_tokens(len(prompt), block)
            header = KvBlocksHeader(
                block_size=block,
                num_tokens=n,
                num_blocks=n // block,
                block_bytes=block * 2048,
                prompt_digest=blockfile.prompt_digest(prompt[:n]),
                layers=[KvLayer(name="fake", dtype="uint8", block_shape=[block * 2048], block_dim=0)],
            )
            blocks = (bytes([prompt[j * block] % 256]) * header.block_bytes for j in range(n // block))
            blockfile.write(self.block_dir / kv[SAVE], header, blocks, kv.get(CHECKSUM))
        elif LOAD in kv:
            header, _ = blockfile.read_header(self.block_dir / kv[LOAD])
            if header.prompt_digest == blockfile.prompt_digest(prompt[: header.num_tokens]):
                self.loaded[rid] = header.num_tokens

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDead("fake engine is dead")

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self.running), waiting=0, unfinished=len(self.running))

    def load_by_rank(self) -> dict[int, EngineLoad]:
        return {0: self.load()}

    async def reset_prefix_cache(self) -> bool:
        return True

    async def sleep(self, level: int) -> str:
        self.sleeping = True
        return "fake engine paused"

    async def wake(self) -> None:
        self.sleeping = False

    async def add_adapter(self, adapter: EngineAdapter) -> None:
        self.adapters[adapter.id] = adapter

    async def remove_adapter(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)

    async def close(self) -> None:
        pass
