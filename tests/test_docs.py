"""The generated parts of the docs match the code, and the README's commands exist."""

from __future__ import annotations

import os
from pathlib import Path

from jetllm.cli import parser
from jetllm.cli.reference import flags_reference, generated_section, messages_reference

ROOT = Path(__file__).resolve().parent.parent


def test_message_reference_matches_the_schemas():
    assert generated_section(ROOT / "docs" / "messages.md") == messages_reference(), (
        "docs/messages.md is stale: run `jetllm schema --markdown --write docs/messages.md`"
    )


def test_operations_lists_every_command_and_flag():
    assert generated_section(ROOT / "docs" / "operations.md") == flags_reference(parser()), (
        "docs/operations.md is stale: run `jetllm flags --write docs/operations.md`"
    )


def test_readme_commands_are_there_and_executable():
    readme = (ROOT / "README.md").read_text()
    for script in ("scripts/demo", "scripts/test"):
        assert script in readme
        assert os.access(ROOT / script, os.X_OK)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/test" in ci


def test_embedded_server_config_is_the_one_in_infra():
    assert (ROOT / "infra" / "nats" / "single-node.conf").resolve() == (
        ROOT / "jetllm" / "data" / "nats-server.conf"
    ).resolve()
