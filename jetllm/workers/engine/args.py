"""vLLM's engine arguments from jetllm's EngineOptions, with the defaults that suit a CPU box."""

from __future__ import annotations

import os
import tempfile
from typing import Any

from ... import reaper
from ...kvtransfer.params import JETLLM_CONNECTOR
from .options import EngineOptions


def _quiet_defaults() -> None:
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def kv_events_config(directory: str) -> Any:
    """vLLM publishes on Unix sockets in a private directory: no ports to choose or collide.

    With data parallelism vLLM derives rank r's address from rank 0's: it shifts a tcp port, adds
    `_dp<r>` when the address contains "inproc", and refuses any other ipc address; hence the
    socket names. The worker reads the addresses back from the engine (`get_kv_event_sources`).
    """
    from vllm.config.kv_events import KVEventsConfig

    base = os.path.join(directory, "inproc")
    if len(base) > 80:  # Unix socket paths end at ~107 bytes, and ranks add a suffix
        raise ValueError(
            f"the temporary directory's path is too long for Unix sockets ({len(base)} bytes): "
            "point TMPDIR somewhere shorter"
        )
    return KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{base}-events",
        replay_endpoint=f"ipc://{base}-replay",
    )


def engine_args(opts: EngineOptions, kv_dir: str | None = None) -> Any:
    """vLLM's engine arguments; `kv_dir` holds the KV-event sockets (a fresh temporary directory
    when None and opts.kv_events is set). The engines this process starts bind their own sockets
    in a directory of its own (`private_rpc_dir`)."""
    _quiet_defaults()
    private_rpc_dir()
    from vllm import AsyncEngineArgs
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    kw: dict[str, Any] = dict(model=opts.model, seed=opts.seed, disable_log_stats=False)
    for name in ("served_model_name", "max_model_len", "block_size", "max_num_seqs"):
        if getattr(opts, name):
            kw[name] = getattr(opts, name)
    dtype = opts.dtype or ("float32" if on_cpu else None)
    if dtype:
        kw["dtype"] = dtype
    kv = opts.kv_cache_bytes or ((1 << 30) if on_cpu else None)
    if kv and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        kw["kv_cache_memory_bytes"] = kv
    if opts.enable_prompt_embeds:
        kw["enable_prompt_embeds"] = True
    eager = opts.enforce_eager if opts.enforce_eager is not None else (True if on_cpu else None)
    if eager is not None:
        kw["enforce_eager"] = eager
    if opts.data_parallel_size > 1:
        kw["data_parallel_size"] = opts.data_parallel_size
        for name in (
            "data_parallel_size_local",
            "data_parallel_start_rank",
            "data_parallel_address",
            "data_parallel_rpc_port",
        ):
            if getattr(opts, name) is not None:
                kw[name] = getattr(opts, name)
    if opts.enable_lora:
        kw.update(enable_lora=True, max_loras=opts.max_loras, max_lora_rank=opts.max_lora_rank)
    if opts.kv_events:
        if opts.extra.get("enable_prefix_caching") is False:
            raise ValueError(
                "KV-cache events come from the prefix cache: they need enable_prefix_caching "
                "(drop enable_prefix_caching=false, or turn KV events off)"
            )
        kw["enable_prefix_caching"] = True
        kw["kv_events_config"] = kv_events_config(kv_dir or kv_sockets_dir())
    kw["kv_transfer_config"] = kv_transfer_config(opts)
    kw.update(whole_prompts(on_cpu))
    extra = dict(opts.extra)
    kw["structured_outputs_config"] = structured_outputs_config(extra.pop("structured_outputs_config", None))
    kw.update(extra)
    return AsyncEngineArgs(**kw)


RPC_BASE = "VLLM_RPC_BASE_PATH"
_PRIVATE = "jetllm-rpc-"
_made: list[str] = []
"""The directories this process made (an inherited one is a parent's)."""


def private_rpc_dir() -> None:
    """vLLM's engine processes bind their ZeroMQ sockets as files in `VLLM_RPC_BASE_PATH` (the
    temporary directory by default), and a killed engine leaves them there: about eight per
    engine start. This process's engines get a directory of their own instead, removed by the
    watchdog when the process ends, however it ends. One per process, so that an engine started
    later in it finds the directory the first one's cached setting names. Left alone when the
    operator set the variable, or when the temporary directory's path is too long for socket names;
    a directory inherited from a jetllm parent is the parent's, so the process makes its own."""
    current = os.environ.get(RPC_BASE)
    if current is not None and (current in _made or not os.path.basename(current).startswith(_PRIVATE)):
        return
    path = tempfile.mkdtemp(prefix=_PRIVATE)
    if len(path) + 40 > 100:  # a socket's name is a uuid (36) under it; Unix ends paths at ~107
        os.rmdir(path)
        return
    reaper.remove_at_exit(path)
    _made.append(path)
    os.environ[RPC_BASE] = path


def kv_sockets_dir() -> str:
    """A directory for the KV-event sockets, gone when this process is."""
    path = tempfile.mkdtemp(prefix="jetllm-kv-")
    reaper.remove_at_exit(path)
    return path


def whole_prompts(on_cpu: bool) -> dict[str, Any]:
    """vLLM rewinds a seeded request's generator when a step prefilled only part of its prompt,
    and a CPU generator cannot rewind: the engine dies (docs/decisions.md). On CPU, whole prompts only.
    Benchmarks give vLLM's own server the same (bench/targets.py)."""
    return {"enable_chunked_prefill": False} if on_cpu else {}


def structured_outputs_config(given: Any) -> Any:
    """One structured-output backend, llguidance, unless the operator names another.

    vLLM's "auto" picks a backend per request (xgrammar, falling back to llguidance) but the
    engine compiles every request with the backend of its first one: a schema that only
    llguidance supports would then be compiled by xgrammar, which ignores what it does not know
    (multipleOf, say) and lets output break the schema. llguidance also compiles lazily: a schema
    with 2,000 optional properties takes it 1.7 s where xgrammar takes 95 s (docs/decisions.md).
    """
    from vllm.config import StructuredOutputsConfig

    if given is None:
        return StructuredOutputsConfig(backend="guidance")
    return StructuredOutputsConfig(**given) if isinstance(given, dict) else given


def kv_transfer_config(opts: EngineOptions) -> Any:
    """None without disaggregation; else jetllm's connector on its block directory, or the one of
    vLLM's own that `--kv-connector` names (both roles of a pair load it in `kv_both`: each engine
    saves what it computes and loads what it is handed)."""
    from vllm.config import KVTransferConfig

    if not opts.kv_block_dir:
        return None
    if opts.kv_connector != JETLLM_CONNECTOR:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        known = sorted(KVConnectorFactory._registry)
        if opts.kv_connector not in known:
            raise ValueError(
                f"--kv-connector {opts.kv_connector!r} is not a KV connector of this vLLM; "
                f"give {JETLLM_CONNECTOR} or one of: {', '.join(known)}"
            )
        return KVTransferConfig(
            kv_connector=opts.kv_connector,
            kv_role="kv_both",
            kv_connector_extra_config=dict(opts.kv_connector_config),
        )
    return KVTransferConfig(
        kv_connector="JetllmKvConnector",
        kv_connector_module_path="jetllm.kvtransfer.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"block_dir": opts.kv_block_dir},
    )
