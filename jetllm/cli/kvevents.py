"""`jetllm kv-events`: the KV-cache event stream of a model, one JSON line per batch."""

from __future__ import annotations

import argparse
import sys

import msgspec

from ..aio import run
from ..producer.kvevents import kv_events
from ..subjects.connection import connect
from ..subjects.names import Names
from ..subjects.server import check_server
from .common import add_nats, nats_url


async def _print(args: argparse.Namespace) -> int:
    if args.from_seq is not None and args.instance is None:
        print("--from-seq counts one instance's batches: add --instance", file=sys.stderr)
        return 2
    nc = await connect(nats_url(args))
    try:
        await check_server(nc)
        names = Names(args.namespace)
        async for d in kv_events(
            nc,
            names,
            args.model,
            instance=args.instance,
            start_seq=args.from_seq,
            stream_seq=args.stream_seq,
            new_only=args.new,
            follow=args.follow,
        ):
            if d.missed:
                print(
                    f"gap: instance {d.batch.instance} seq {d.batch.seq - d.missed}..{d.batch.seq - 1} "
                    "expired from the stream",
                    file=sys.stderr,
                )
            sys.stdout.write(msgspec.json.encode(d.batch).decode() + "\n")
            sys.stdout.flush()
    finally:
        await nc.close()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "kv-events",
        help="print KV-cache events, one JSON line per batch",
        description="Replay the KV-cache events of a model's instances from JetStream (oldest "
        "kept first), one JSON line per batch; gaps in an instance's seq go to stderr.",
    )
    add_nats(p)
    p.add_argument("--model", required=True, help="model name as jobs use it")
    p.add_argument(
        "--instance", default=None, help="one instance only (default: every instance of the model)"
    )
    p.add_argument(
        "--from-seq",
        type=int,
        default=None,
        metavar="N",
        help="start at the instance's batch N (with --instance)",
    )
    p.add_argument("--stream-seq", type=int, default=None, metavar="S", help="start at stream sequence S")
    p.add_argument("--new", action="store_true", help="only batches published from now on")
    p.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing new batches until interrupted (default: stop at the end of the stream)",
    )

    def main(a: argparse.Namespace) -> int:
        try:
            return run(_print, a)
        except KeyboardInterrupt:
            return 0

    p.set_defaults(func=main)
