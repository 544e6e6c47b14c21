"""`jetllm nats-config`: the server's accounts block for jetllm's identities (infra/nats/accounts.conf)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_nats_config(args: argparse.Namespace) -> int:
    from ..subjects.natsconfig import accounts_config, default_users, parse_user

    try:
        users = [parse_user(u) for u in args.user or []] + [parse_user(k, nkey=True) for k in args.nkey or []]
        text = accounts_config(args.namespace or ["default"], users or default_users())
    except ValueError as exc:
        print(f"jetllm nats-config: {exc}", file=sys.stderr)
        return 2
    if args.write:
        Path(args.write).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "nats-config",
        help="print the nats-server accounts block: a user per identity, allowed only what its role needs",
        description="Print the nats-server `accounts` block for jetllm's identities: each user may "
        "publish and subscribe only to what its access role (producer, router, worker, admin) needs "
        "in the namespaces given (docs/security.md). Passwords are read by the server from "
        "JETLLM_<USER>_PASSWORD.",
    )
    p.add_argument(
        "--namespace",
        action="append",
        default=None,
        help="namespace the users work in (repeatable; default: default)",
    )
    p.add_argument(
        "--user",
        action="append",
        default=None,
        metavar="ROLE:NAME",
        help="a user with a password, e.g. producer:alice (repeatable; default: one user per role, "
        "named after it)",
    )
    p.add_argument(
        "--nkey",
        action="append",
        default=None,
        metavar="ROLE:PUBLIC_KEY",
        help="a user authenticated by an nkey, e.g. worker:UABC... (repeatable)",
    )
    p.add_argument("--write", default=None, metavar="FILE", help="write it to FILE instead of stdout")
    p.set_defaults(func=cmd_nats_config)
