"""A worker's flags (`jetllm worker`, `jetllm up`, and the prefill worker `up --disagg` starts),
and the engine options and worker settings they become."""

from __future__ import annotations

import argparse

from .common import TINY_MODEL_NAME, json_object, parse_kv


def add_worker_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument(
        "--model",
        default=None,
        help="model directory or name vLLM can load (default: the bundled tiny model, built on first use)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help=f"name jobs use for the model (default: --model, or '{TINY_MODEL_NAME}' for the tiny model)",
    )
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--dtype", default=None, help="default: float32 on CPU, vLLM's 'auto' elsewhere")
    g.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="KV cache size in bytes (default on CPU: 1 GiB; on GPU vLLM sizes it)",
    )
    g.add_argument("--block-size", type=int, default=None, help="KV block size (a multiple of 32 on CPU)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="engine batch limit")
    g.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="skip graph compilation (default on CPU: on)",
    )
    g.add_argument("--seed", type=int, default=0, help="engine seed (requests without their own seed)")
    g.add_argument(
        "--enable-prompt-embeds",
        action="store_true",
        help="accept embeddings prompts (off by default: it slows every request a little)",
    )
    g.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="relay the engine's KV-cache events to JetStream for KV-aware routing (turns prefix "
        "caching on; costs about nothing, see docs/fleet.md)",
    )
    g.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other vLLM AsyncEngineArgs field, VALUE as JSON (repeatable)",
    )
    d = p.add_argument_group(
        "data parallel (one worker schedules onto every rank; other hosts run --headless)"
    )
    d.add_argument("--data-parallel-size", type=int, default=1, help="engine ranks in total")
    d.add_argument(
        "--data-parallel-size-local",
        type=int,
        default=None,
        help="ranks on this host (default: all); the others join from --headless processes",
    )
    d.add_argument(
        "--data-parallel-start-rank", type=int, default=None, help="first rank of a --headless process"
    )
    d.add_argument("--data-parallel-address", default=None, help="the leader's address, for headless ranks")
    d.add_argument(
        "--data-parallel-rpc-port",
        type=int,
        default=None,
        help="the leader's port for headless ranks (only needed with --headless ranks)",
    )
    d.add_argument(
        "--headless",
        action="store_true",
        help="run engine ranks for a leader on another host: no NATS, no jobs, no control subjects",
    )
    lo = p.add_argument_group("LoRA adapters")
    lo.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters of the model (jetllm lora load)"
    )
    lo.add_argument("--max-loras", type=int, default=1, help="adapters this worker holds at once")
    lo.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted")
    lo.add_argument(
        "--lora-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="directory path sources may come from (repeatable); none: path sources are refused",
    )
    lo.add_argument(
        "--lora-cache-dir",
        default=None,
        metavar="DIR",
        help="where verified adapter copies are kept by content hash (default: jetllm's cache directory)",
    )
    lo.add_argument(
        "--lora-cache-max-bytes",
        type=int,
        default=10 << 30,
        metavar="N",
        help="above this size, copies no worker on this host uses are removed, oldest use first (0: never)",
    )
    lo.add_argument(
        "--lora-allow-hub",
        action="store_true",
        help="allow hub sources (the worker downloads them; needs network access)",
    )
    w = p.add_argument_group("worker")
    w.add_argument(
        "--role",
        default="generate",
        metavar="ROLE",
        help="what the worker does with its jobs: generate (default: prefill and decode on this "
        "engine), prefill (computes prompts' KV blocks for decode workers) or decode (generate, "
        "with long prompts prefilled by prefill workers); a flag that means nothing for the role is refused",
    )
    w.add_argument(
        "--slots",
        type=int,
        default=None,
        help="jobs run at once; never more un-acked jobs than this (default: the engine's max_num_seqs)",
    )
    w.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="seconds running requests get to finish on SIGTERM before they are handed back",
    )
    w.add_argument(
        "--heartbeat-interval",
        type=float,
        default=0.5,
        help="seconds between heartbeat frames of a quiet request",
    )
    w.add_argument(
        "--checkpoint-interval",
        type=float,
        default=0.5,
        help="seconds between request-log checkpoints of a request's token frames; the producer holds "
        "newer ones and hands them to the worker that takes over (0: log every frame before it is sent)",
    )
    w.add_argument(
        "--detached-checkpoint-interval",
        type=float,
        default=5.0,
        help="the same for a detached job (no reply subject, e.g. a batch line): nobody saw its newest "
        "tokens, so a worker that dies costs at most this long a generation again",
    )
    w.add_argument(
        "--max-migrations",
        type=int,
        default=3,
        help="default migration budget: how often workers may die under one request before it fails "
        "(a request's max_migrations overrides it; planned hand-backs do not count)",
    )
    w.add_argument("--health-interval", type=float, default=5.0, help="seconds between engine health checks")
    w.add_argument(
        "--max-embeds-bytes",
        type=int,
        default=None,
        help="largest embeddings prompt accepted, in bytes (default: max-model-len * hidden size * 4; "
        "never more than 1 GiB)",
    )
    w.add_argument("--instance-id", default=None, help="default: <host>-<pid>-<random>")
    w.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus endpoint port; 0 picks a free one and publishes it in the registry "
        "(no ports to assign by hand)",
    )
    w.add_argument(
        "--no-metrics",
        action="store_true",
        help="no Prometheus endpoint, and vLLM keeps none of its metrics (the load routers see is still reported)",
    )
    w.add_argument(
        "--registry-interval",
        type=float,
        default=2.0,
        help="seconds between registry heartbeats; a silent worker stops counting after 3",
    )
    w.add_argument(
        "--nats-wait", type=float, default=60.0, help="seconds to keep retrying the first connection to NATS"
    )
    d = p.add_argument_group("prefill/decode disaggregation (--role prefill / decode)")
    d.add_argument(
        "--disagg-threshold",
        type=int,
        default=256,
        metavar="TOKENS",
        help="decode: prompts shorter than this are prefilled here (default: 256)",
    )
    d.add_argument(
        "--disagg-cached-fraction",
        type=_cached_fraction,
        default=0.5,
        metavar="F",
        help="decode: prefill here when this share of the prompt is in this engine's prefix cache "
        "already (0 turns it off; seen through the engine's KV-cache events: not with --no-kv-events)",
    )
    d.add_argument(
        "--max-prefill-queue",
        type=int,
        default=16,
        metavar="N",
        help="decode: prefill here when this many prefill jobs already wait for a prefill worker",
    )
    d.add_argument(
        "--prefill-timeout",
        type=float,
        default=30.0,
        help="decode: seconds to wait for a prefill worker's answer before prefilling here",
    )
    d.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=30.0,
        help="decode: seconds the announced KV blocks get to arrive before prefilling here",
    )
    d.add_argument(
        "--kv-transfer",
        choices=("direct", "stored"),
        default="direct",
        help="decode: how the prefill worker sends the KV blocks: direct (to this worker, stored "
        "nowhere; a transfer that arrives incomplete is prefilled here) or stored (through the "
        "server's block stream, read back for what this worker's subscription missed, at the "
        "price of the server storing every block)",
    )
    d.add_argument(
        "--kv-ttl",
        type=float,
        default=120.0,
        help="seconds the block store keeps KV blocks nobody removed (a decode worker died)",
    )
    d.add_argument(
        "--kv-store-bytes",
        type=int,
        default=256 << 20,
        metavar="N",
        help="bytes of KV blocks the store holds at once; beyond it new ones are refused and decode "
        "workers prefill themselves (the store is created by the first prefill worker, and the "
        "server reserves these bytes from its max_memory_store)",
    )
    d.add_argument(
        "--kv-connector",
        default="jetllm",
        metavar="NAME",
        help="the engine's KV connector: jetllm (blocks through NATS, the default) or one of vLLM's "
        "own (NixlConnector on GPU boxes, ExampleConnector on a shared filesystem); prefill and "
        "decode workers of one fleet need the same one",
    )
    d.add_argument(
        "--kv-connector-config",
        type=json_object("--kv-connector-config"),
        default={},
        metavar="JSON",
        help="a JSON object: the vLLM connector's kv_connector_extra_config "
        """(e.g. '{"shared_storage_path": "/mnt/kv"}')""",
    )
    q = p.add_argument_group("queue policy (applied when creating or updating streams and consumers)")
    q.add_argument(
        "--ack-wait",
        type=float,
        default=10.0,
        help="seconds before an un-acked job is redelivered (running jobs refresh it)",
    )
    q.add_argument(
        "--max-deliver",
        type=int,
        default=10,
        help="deliveries of a job before JetStream gives up and it is dead-lettered (a backstop "
        "behind the migration budget)",
    )
    q.add_argument(
        "--max-age",
        type=float,
        default=None,
        help="seconds a queued job may wait for a worker (default: as the namespace's jobs stream has "
        "it, 86400 in a new namespace; without the flag nothing existing is changed)",
    )
    q.add_argument(
        "--replicas",
        type=_replicas,
        default=None,
        help="copies of every stream and bucket: 3 on a JetStream cluster (default: as many as the "
        "namespace's jobs stream has, 1 in a new namespace; without the flag nothing existing is rescaled)",
    )


def _replicas(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= 5:
        raise argparse.ArgumentTypeError(
            f"--replicas must be 1 to 5 (JetStream keeps at most 5 copies), got {text!r}"
        )
    return n


def _cached_fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        f = -1.0
    if not 0 <= f <= 1:
        raise argparse.ArgumentTypeError(
            f"--disagg-cached-fraction must be 0 to 1 (a share of the prompt; 0 turns it off), got {text!r}"
        )
    return f


def engine_options(args: argparse.Namespace):
    from ..workers.engine import EngineOptions

    model, served = args.model, args.served_model_name
    if model is None:
        from .. import tinymodel

        model = str(tinymodel.ensure())
        served = served or TINY_MODEL_NAME
    return EngineOptions(
        model=model,
        served_model_name=served,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_bytes,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        data_parallel_size=args.data_parallel_size,
        data_parallel_size_local=args.data_parallel_size_local,
        data_parallel_start_rank=args.data_parallel_start_rank,
        data_parallel_address=args.data_parallel_address,
        data_parallel_rpc_port=args.data_parallel_rpc_port,
        enable_prompt_embeds=args.enable_prompt_embeds,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        engine_metrics=not args.no_metrics,
        kv_events=args.kv_events,
        kv_connector=args.kv_connector,
        kv_connector_config=args.kv_connector_config,
        extra=parse_kv(args.engine_arg),
    )


def worker_config(args: argparse.Namespace, slots: int | None = None):
    from ..subjects.policy import QueuePolicy
    from ..workers import WorkerConfig
    from ..workers.config import DisaggSettings
    from ..workers.lora import LoraSettings

    return WorkerConfig(
        namespace=args.namespace,
        role=args.role,
        slots=slots or args.slots or 0,
        heartbeat_interval=args.heartbeat_interval,
        checkpoint_interval=args.checkpoint_interval,
        detached_checkpoint_interval=args.detached_checkpoint_interval,
        max_migrations=args.max_migrations,
        grace_period=args.grace_period,
        health_interval=args.health_interval,
        instance=args.instance_id,
        metrics_port=None if args.no_metrics else args.metrics_port,
        registry_interval=args.registry_interval,
        max_embeds_bytes=args.max_embeds_bytes,
        lora=LoraSettings(
            dirs=args.lora_dir,
            cache_dir=args.lora_cache_dir,
            allow_hub=args.lora_allow_hub,
            cache_max_bytes=args.lora_cache_max_bytes,
        ),
        disagg=DisaggSettings(
            threshold=args.disagg_threshold,
            cached_fraction=args.disagg_cached_fraction,
            max_prefill_queue=args.max_prefill_queue,
            prefill_timeout=args.prefill_timeout,
            transfer_timeout=args.kv_transfer_timeout,
            stored=args.kv_transfer == "stored",
            kv_ttl=args.kv_ttl,
            kv_store_bytes=args.kv_store_bytes,
            connector=args.kv_connector,
        ),
        policy=QueuePolicy(
            ack_wait=args.ack_wait,
            max_deliver=args.max_deliver,
            max_age=args.max_age,
            replicas=args.replicas,
        ),
    )


def given_flags(args: argparse.Namespace) -> list[str]:
    """The worker options set to something other than their default, by their first option string."""
    ref = argparse.ArgumentParser(add_help=False)
    add_worker_options(ref)
    return [
        action.option_strings[0]
        for action in ref._actions
        if action.option_strings and getattr(args, action.dest, action.default) != action.default
    ]
