"""`jetllm dlq list|show|replay`: the jobs that could not be served, and sending them again."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys

import msgspec

from ..aio import run
from ..producer.deadletters import entries, get, replay
from ..subjects import codec
from ..subjects.connection import connect
from ..subjects.names import Names
from ..subjects.server import check_server
from .common import add_nats, nats_url


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


async def _list(args: argparse.Namespace) -> int:
    nc = await connect(nats_url(args))
    try:
        await check_server(nc)
        rows = await entries(nc, Names(args.namespace), limit=args.limit)
    finally:
        await nc.close()
    if args.json:
        for e in rows:
            print(
                msgspec.json.encode(
                    {
                        "seq": e.seq,
                        **{k: v for k, v in msgspec.to_builtins(e.record).items() if k != "payload"},
                    }
                ).decode()
            )
        return 0
    if not rows:
        print("no dead letters", file=sys.stderr)
        return 0
    print(f"{'seq':>6}  {'failed at (UTC)':19}  {'code':26}  {'deliv':>5}  {'request':24}  reason")
    for e in rows:
        r = e.record
        print(
            f"{e.seq:>6}  {_when(r.failed_at):19}  {r.code.value:26}  {r.deliveries:>5}  "
            f"{(r.request_id or '-')[:24]:24}  {r.reason[:80]}"
        )
    return 0


async def _show(args: argparse.Namespace) -> int:
    nc = await connect(nats_url(args))
    try:
        e = await get(nc, Names(args.namespace), args.seq)
    finally:
        await nc.close()
    out = msgspec.to_builtins(e.record)
    try:
        encoding = codec.encoding_of(e.record.headers)
        job = (
            msgspec.json.decode(e.record.payload)
            if encoding == "json"
            else msgspec.msgpack.decode(e.record.payload)
        )
        out["payload"] = job
    except Exception:
        out["payload"] = repr(e.record.payload[:2000])
    out["seq"] = e.seq
    print(json.dumps(out, indent=2, default=str))
    return 0


async def _replay(args: argparse.Namespace) -> int:
    nc = await connect(nats_url(args))
    names = Names(args.namespace)
    try:
        if args.all:
            chosen = [
                e for e in await entries(nc, names) if args.code is None or e.record.code.value == args.code
            ]
        else:
            chosen = [await get(nc, names, seq) for seq in args.seq]
        for e in chosen:
            subject = await replay(nc, names, e, keep=args.keep)
            print(f"replayed {e.seq} ({e.record.request_id or 'no request id'}) to {subject}")
    finally:
        await nc.close()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dlq",
        help="list, show and replay dead-lettered jobs",
        description="Jobs that could not be served, kept with the reason in the dead-letter stream.",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)

    v = verbs.add_parser(
        "list", help="one line per dead letter", description="List dead letters, oldest first."
    )
    add_nats(v)
    v.add_argument("--limit", type=int, default=None, help="only the newest N")
    v.add_argument("--json", action="store_true", help="one JSON object per line (without payloads)")
    v.set_defaults(func=lambda a: run(_list, a))

    v = verbs.add_parser(
        "show",
        help="one dead letter in full, its job decoded",
        description="Print one dead letter with its job decoded.",
    )
    add_nats(v)
    v.add_argument("seq", type=int, help="sequence number from `jetllm dlq list`")
    v.set_defaults(func=lambda a: run(_show, a))

    v = verbs.add_parser(
        "replay",
        help="publish dead-lettered jobs again",
        description="Publish dead-lettered jobs to their subject again, so they run afresh.",
    )
    add_nats(v)
    v.add_argument("seq", type=int, nargs="*", help="sequence numbers from `jetllm dlq list`")
    v.add_argument("--all", action="store_true", help="every dead letter (with --code: of that code)")
    v.add_argument("--code", default=None, help="with --all: only this error code")
    v.add_argument("--keep", action="store_true", help="leave the records in the dead-letter stream")
    v.set_defaults(func=lambda a: run(_replay, a))
