"""Options and helpers shared by the commands."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from ..subjects.connection import default_url

TINY_MODEL_NAME = "tiny"
"""What the bundled tiny model is called on the wire."""


NATS_FILES = (
    ("--nats-creds", "NATS_CREDS", "a NATS credentials file: user JWT and nkey seed"),
    ("--nats-nkey", "NATS_NKEY", "a file holding an nkey seed"),
    ("--nats-ca", "NATS_CA", "CA certificate(s) that signed the server's, for tls:// URLs"),
    ("--nats-cert", "NATS_CERT", "client certificate, for servers that require one"),
    ("--nats-key", "NATS_KEY", "the client certificate's key"),
)
"""Flags naming credential and TLS files, and the variable each sets (subjects/connection.py reads them)."""


def add_nats(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nats",
        default=None,
        metavar="URL",
        help="NATS server URL(s), comma separated (default: $NATS_URL, else nats://127.0.0.1:4222); "
        "tls://host:port for TLS; a user and password may be in the URL or in $NATS_USER and $NATS_PASSWORD",
    )
    for flag, variable, meaning in NATS_FILES:
        p.add_argument(flag, default=None, metavar="FILE", help=f"{meaning} (default: ${variable})")
    p.add_argument(
        "--require-tls",
        action="store_true",
        help="refuse any NATS URL that is not tls:// (default: $JETLLM_REQUIRE_TLS)",
    )
    p.add_argument(
        "--namespace",
        default=os.environ.get("JETLLM_NAMESPACE", "default"),
        help="jetllm namespace: separate streams and subjects per deployment (default: $JETLLM_NAMESPACE or 'default')",
    )


def nats_url(args: argparse.Namespace) -> str:
    return args.nats or default_url()


def export_nats_flags(args: argparse.Namespace) -> None:
    """Hand the credential and TLS flags to every connection the command opens (its own, a Client's,
    a worker's), the way the environment does: a flag overrides its variable."""
    for flag, variable, _ in NATS_FILES:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value:
            os.environ[variable] = value
    if getattr(args, "require_tls", False):
        os.environ["JETLLM_REQUIRE_TLS"] = "1"


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("nats").setLevel(logging.WARNING)


def json_object(flag: str) -> Callable[[str], dict[str, Any]]:
    """An argparse type: a JSON object, or an error naming `flag`."""

    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(
                f"{flag} is not JSON ({exc}); give an object like '{{}}'"
            ) from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON object, not {type(value).__name__}")
        return value

    return parse


def parse_kv(items: list[str]) -> dict[str, object]:
    """KEY=VALUE pairs; VALUE is parsed as JSON when it can be (numbers, booleans, objects)."""
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected KEY=VALUE, got {item!r}")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    return out
