"""Prompt -> token ids, as the worker's renderer produces them (workers/engine/vllm_engine.py).

The router tokenizes locally with the model's own tokenizer files (transformers), rather than
asking a worker to render: a round trip per job would cost more than the decision it serves, and
a router must keep deciding while workers are busy. Text prompts are encoded with special tokens
(vLLM's completions path); chat prompts are rendered with the tokenizer's chat template to text
and encoded without them (vLLM's chat path). tests/test_vllm_router.py checks both against the engine.
"""

from __future__ import annotations

from typing import Any

import anyio

from ..schemas import ChatPrompt, Prompt, TextPrompt, TokensPrompt


class PromptTokenizer:
    def __init__(self, path: str) -> None:
        """`path`: the model's directory or hub id (the worker's --model), or a tokenizer of its own."""
        from transformers import AutoTokenizer  # noqa: PLC0415 - heavy; only routers need it

        self.path = path
        self._tok: Any = AutoTokenizer.from_pretrained(path)

    def tokens(self, prompt: Prompt) -> list[int] | None:
        """The prompt's token ids; None for a prompt the router cannot see into (embeddings)."""
        if isinstance(prompt, TokensPrompt):
            return list(prompt.token_ids)
        if isinstance(prompt, TextPrompt):
            return list(self._tok.encode(prompt.text, add_special_tokens=True))
        if isinstance(prompt, ChatPrompt):
            kwargs = dict(prompt.template_kwargs or {})
            text = self._tok.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in prompt.messages],
                tokenize=False,
                add_generation_prompt=prompt.add_generation_prompt,
                continue_final_message=prompt.continue_final_message,
                **kwargs,
            )
            return list(self._tok.encode(text, add_special_tokens=False))
        return None

    async def tokens_async(self, prompt: Prompt) -> list[int] | None:
        """Long prompts take milliseconds to tokenize: off the event loop."""
        if isinstance(prompt, TokensPrompt):
            return list(prompt.token_ids)
        return await anyio.to_thread.run_sync(self.tokens, prompt)
