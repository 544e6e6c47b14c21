"""`jetllm up --disagg`: the prefill worker it starts beside its decode worker gets the same
settings, minus those only a decode worker takes."""

from __future__ import annotations

import pytest

from jetllm.cli import parser
from jetllm.cli.disagg import worker_argv
from jetllm.cli.worker_cmd import check_role


@pytest.mark.parametrize(
    ("up", "prefill"),
    [
        ([], ["--role", "prefill"]),
        (
            ["--slots", "4", "--kv-ttl", "30", "--disagg-threshold", "64", "--no-kv-events"],
            ["--role", "prefill", "--no-kv-events", "--slots", "4", "--kv-ttl", "30.0"],
        ),
        (["--kv-transfer", "stored", "--kv-transfer-timeout", "5"], ["--role", "prefill"]),  # decode's
        (
            ["--engine-arg", "a=1", "--engine-arg", "b=2", "--max-migrations", "5", "--instance-id", "x"],
            ["--role", "prefill", "--engine-arg", "a=1", "--engine-arg", "b=2"],
        ),
        (
            ["--kv-connector", "ExampleConnector", "--kv-connector-config", '{"shared_storage_path": "/s"}'],
            [
                "--role",
                "prefill",
                "--kv-connector",
                "ExampleConnector",
                "--kv-connector-config",
                '{"shared_storage_path": "/s"}',
            ],
        ),
    ],
)
def test_the_prefill_worker_repeats_what_it_takes_of_ups_flags(up, prefill):
    args = parser().parse_args(["up", "--disagg", *up])
    argv = worker_argv(args, "prefill")
    assert argv == prefill
    worker = parser().parse_args(["worker", *argv])
    assert check_role(worker) is None  # nothing a prefill worker would refuse


@pytest.mark.parametrize(
    ("value", "says"),
    [("{not json", "--kv-connector-config is not JSON"), ("[1, 2]", "must be a JSON object, not list")],
)
def test_a_connector_config_that_is_not_a_json_object_is_refused_naming_the_flag(value, says, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["worker", "--role", "decode", "--kv-connector-config", value])
    assert says in capsys.readouterr().err
