"""A worker process on the light test engine, for tests that SIGKILL workers cheaply.

Usage: python -m tests.helpers.fake_worker NATS_URL NAMESPACE [--step-delay S] [--slots N] ...
"""

from __future__ import annotations

import argparse
import logging

from jetllm import taskdump
from jetllm.aio import run
from jetllm.subjects.connection import connect
from jetllm.subjects.policy import QueuePolicy
from jetllm.workers import Worker, WorkerConfig
from tests.fake_engine import FakeEngine


async def main(args: argparse.Namespace) -> int:
    if args.stuck_before_claim:
        import anyio

        from jetllm.workers.requestlog import RequestLog

        async def never(self, request_id):  # the log never answers: each job stays pulled, unclaimed
            await anyio.sleep_forever()

        RequestLog.last = never  # type: ignore[method-assign]
    nc = await connect(args.url, name="fake-worker")
    engine = FakeEngine(step_delay=args.step_delay, max_model_len=args.max_model_len)
    config = WorkerConfig(
        namespace=args.namespace,
        slots=args.slots,
        grace_period=args.grace_period,
        max_migrations=args.max_migrations,
        heartbeat_interval=0.2,
        checkpoint_interval=args.checkpoint_interval,
        detached_checkpoint_interval=args.detached_checkpoint_interval,
        policy=QueuePolicy(ack_wait=args.ack_wait, replicas=args.replicas),
    )
    try:
        with taskdump.dump_on_signal():  # as `jetllm worker`: a failing test's report dumps its tasks
            return await Worker(nc, engine, config).serve()
    finally:
        await nc.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("namespace")
    p.add_argument("--step-delay", type=float, default=0.01)
    p.add_argument("--max-model-len", type=int, default=100_000)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--grace-period", type=float, default=30.0)
    p.add_argument("--max-migrations", type=int, default=3)
    p.add_argument("--ack-wait", type=float, default=10.0)
    p.add_argument("--checkpoint-interval", type=float, default=0.5)
    p.add_argument("--detached-checkpoint-interval", type=float, default=5.0)
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--stuck-before-claim", action="store_true", help="never get past reading the request log")
    args = p.parse_args()
    taskdump.ignore_until_ready()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise SystemExit(run(main, args))
