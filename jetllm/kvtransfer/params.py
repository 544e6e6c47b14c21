"""What a worker asks of the engine's KV connector for one request, and what a block file covers.

Kept apart from connector.py, which imports torch and vLLM: the roles decide with these without
loading either.
"""

from __future__ import annotations

SAVE = "jetllm_save"
"""`kv_transfer_params` key: write the prompt's full blocks to this block file (prefill)."""
LOAD = "jetllm_load"
"""`kv_transfer_params` key: take the prompt's first tokens from this block file (decode)."""


def full_block_tokens(prompt_len: int, block_size: int) -> int:
    """Tokens a block file covers for a prompt: whole blocks, leaving the last token to compute
    (the engine needs its logits)."""
    return max(prompt_len - 1, 0) // block_size * block_size
