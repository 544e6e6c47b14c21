"""Options and helpers shared by the commands."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from ..subjects.connection import default_url

TINY_MODEL_NAME = "tiny"
"""What the bundled tiny model is called on the wire."""


def add_nats(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nats",
        default=None,
        metavar="URL",
        help="NATS server URL(s), comma separated (default: $NATS_URL, else nats://127.0.0.1:4222); "
        "credentials may be in the URL or in a creds file named by $NATS_CREDS",
    )
    p.add_argument(
        "--namespace",
        default=os.environ.get("JETLLM_NAMESPACE", "default"),
        help="jetllm namespace: separate streams and subjects per deployment (default: $JETLLM_NAMESPACE or 'default')",
    )


def nats_url(args: argparse.Namespace) -> str:
    return args.nats or default_url()


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("nats").setLevel(logging.WARNING)


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
