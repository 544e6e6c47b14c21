"""What a worker asks of the engine's KV connector for one request, and what a block file covers.

Kept apart from connector.py, which imports torch and vLLM: the roles decide with these without
loading either.
"""

from __future__ import annotations

JETLLM_CONNECTOR = "jetllm"
"""`--kv-connector` naming jetllm's own connector (blocks through NATS), the default."""
SAVE = "jetllm_save"
"""`kv_transfer_params` key: write the prompt's full blocks to this block file (prefill)."""
CHECKSUM = "jetllm_checksum"
"""`kv_transfer_params` key beside SAVE: take every block's checksum this way as it is written
(blockfile.read_sums), while the bytes are in cache, rather than in a second pass on publishing."""
LOAD = "jetllm_load"
"""`kv_transfer_params` key: take the prompt's first tokens from this block file (decode)."""


REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""`kv_transfer_params` of a prefill with one of vLLM's own connectors: vLLM's convention for a
prefill whose blocks another engine decodes from (NIXL keeps them for it and returns where they
are; connectors that store every prompt, like the example one, ignore it)."""


def full_block_tokens(prompt_len: int, block_size: int) -> int:
    """Tokens a block file covers for a prompt: whole blocks, leaving the last token to compute
    (the engine needs its logits)."""
    return max(prompt_len - 1, 0) // block_size * block_size
