"""How to start an engine: the few settings jetllm chooses, plus any vLLM engine argument."""

from __future__ import annotations

from typing import Any

import msgspec


class EngineOptions(msgspec.Struct, kw_only=True):
    model: str
    """A local directory or a model name vLLM can load."""
    served_model_name: str | None = None
    """The name jobs use; defaults to `model`."""
    max_model_len: int | None = None
    dtype: str | None = None
    """None: float32 on CPU (bf16 takes an AMX path that crashes on some CPUs), else vLLM's auto."""
    kv_cache_bytes: int | None = None
    """None: 1 GiB on CPU (vLLM would otherwise reserve 92% of the node), else vLLM's default."""
    block_size: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool | None = None
    """None: True on CPU (compiling takes minutes on small CPUs), else vLLM's default."""
    seed: int = 0
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    """Ranks run on this host (default: all of them); the rest run in `--headless` processes."""
    data_parallel_start_rank: int | None = None
    """First rank of a headless process."""
    data_parallel_address: str | None = None
    """Where the leader's engines listen for headless ranks (the leader's address)."""
    data_parallel_rpc_port: int | None = None
    enable_prompt_embeds: bool = False
    """Accept embeddings prompts. Off by default: vLLM then runs the embedding layer outside the
    compiled model for every request, which costs speed, and the worker takes tensors from jobs."""
    enable_lora: bool = False
    max_loras: int = 1
    """Adapters held at once (and run in one batch)."""
    max_lora_rank: int = 16
    engine_metrics: bool = True
    """Keep vLLM's Prometheus metrics (the worker's `/metrics` serves them). False when the worker
    serves no metrics endpoint: vLLM would otherwise still update its histograms at every engine
    step, one observation per token, for nobody."""
    kv_events: bool = False
    """Publish KV-cache events (turns prefix caching on; the worker relays them to JetStream)."""
    kv_block_dir: str | None = None
    """Load a KV connector (the prefill and decode roles set it): jetllm's exchanges block files in
    this private directory (the connector's module docstring says how)."""
    kv_connector: str = "jetllm"
    """`jetllm`, or the name of one of vLLM's own KV connectors (NixlConnector, ExampleConnector...)."""
    kv_connector_config: dict[str, Any] = {}
    """That connector's `kv_connector_extra_config` (vLLM's connectors only)."""
    extra: dict[str, Any] = {}
    """Any other AsyncEngineArgs field, passed through unchanged."""

    @property
    def name(self) -> str:
        return self.served_model_name or self.model
