"""`jetllm router`: a KV-aware router service placing the jobs of one model from the routing queue."""

from __future__ import annotations

import argparse
import logging

import anyio

from ..aio import run, task_group
from ..router.cost import Weights
from ..router.hashing import DEFAULT_SEED
from ..router.router import Router
from ..router.service import serve
from ..subjects.connection import connect
from ..subjects.names import Names
from ..subjects.server import check_server
from .common import add_nats, nats_url

log = logging.getLogger(__name__)


def add_weights(p: argparse.ArgumentParser) -> None:
    w = Weights()
    g = p.add_argument_group("cost weights (in prompt tokens; docs/routing.md)")
    g.add_argument("--w-compute", type=float, default=w.compute, help="per uncached prompt token")
    g.add_argument("--w-queue", type=float, default=w.queue, help="per unit of (running + waiting) / slots")
    g.add_argument("--w-kv", type=float, default=w.kv, help="per unit of KV-cache usage (0..1)")
    g.add_argument("--tie", type=float, default=w.tie, help="costs closer than this are a tie: shared queue")
    g.add_argument(
        "--min-cached",
        type=int,
        default=w.min_cached,
        help="fewest cached tokens on the best instance that make a job worth directing",
    )


def weights_of(a: argparse.Namespace) -> Weights:
    return Weights(compute=a.w_compute, queue=a.w_queue, kv=a.w_kv, tie=a.tie, min_cached=a.min_cached)


async def _serve(a: argparse.Namespace) -> int:
    nc = await connect(nats_url(a), name=f"jetllm-router-{a.name}")
    try:
        await check_server(nc)
        names = Names(a.namespace)
        router = Router(
            a.model,
            tokenizer=a.tokenizer,
            weights=weights_of(a),
            block_size=a.block_size,
            hash_seed=a.hash_seed,
            hash_algo=a.hash_algo,
            name=a.name,
        )
        if a.metrics_port is not None:
            from ..router.metrics import RouterCollector
            from ..workers.metrics import serve_metrics

            serve_metrics(RouterCollector(router), a.metrics_port)
        async with router.running(nc, names):
            log.info(
                "router %s: %d blocks of %d instances indexed",
                a.name,
                router.index.blocks,
                len(router.index.instances()),
            )
            async with task_group() as tg:
                tg.start_soon(_report, router)
                await serve(nc, names, router, ack_wait=a.ack_wait)
    finally:
        await nc.close()
    return 0


async def _report(router: Router) -> None:
    while True:
        await anyio.sleep(60)
        s = router.stats
        log.info(
            "router %s: %d jobs, %d directed, hit rate %.0f%%, decision p50 %.0f us p99 %.0f us",
            router.name,
            s.decisions,
            s.directed,
            s.hit_rate * 100,
            s.percentile(0.5),
            s.percentile(0.99),
        )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "router",
        help="KV-aware router: place jobs of the routing queue on the worker holding their prefix",
        description="Take jobs from the routing queue (producers: Client(via_routers=True)) and publish "
        "each to the instance that would compute least of its prompt, or to the shared queue. Run "
        "several for availability: each job is placed once.",
    )
    add_nats(p)
    p.add_argument("--model", required=True, help="the served model name (one router per model)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="the model's files (directory or hub id) to tokenize text and chat prompts; without it "
        "only token prompts are routed, the rest go to the shared queue",
    )
    p.add_argument("--name", default="router", help="this router's name in traces and metrics")
    p.add_argument("--block-size", type=int, default=None, help="default: the workers' (from the registry)")
    p.add_argument(
        "--hash-seed",
        default=DEFAULT_SEED,
        help="the workers' PYTHONHASHSEED if they set one (default: vLLM's fixed seed)",
    )
    p.add_argument(
        "--hash-algo",
        choices=["sha256", "sha256_cbor"],
        default="sha256",
        help="the workers' --prefix-caching-hash-algo",
    )
    p.add_argument(
        "--ack-wait", type=float, default=30.0, help="seconds before an unacked job is redelivered"
    )
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    add_weights(p)
    p.set_defaults(func=lambda a: run(_serve, a))
