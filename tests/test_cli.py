"""The `jetllm` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import TINY


def jetllm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jetllm", *args], capture_output=True, text=True, timeout=timeout
    )


def test_schema_writes_one_json_schema_per_message(tmp_path):
    r = jetllm("schema", "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "GenerateRequest.schema.json" in files and "Frame.schema.json" in files
    schema = json.loads((tmp_path / "GenerateRequest.schema.json").read_text())
    assert "$defs" in schema and "GenerateRequest" in schema["$defs"]


def test_producer_commands_do_not_import_vllm():
    code = "import sys, jetllm.cli, jetllm.producer, jetllm.subjects, jetllm.batch; print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.split()
    assert out == ["False", "False"]


def test_from_jetllm_import_client_works_and_the_watchdog_loads_no_nats_client():
    code = (
        "import sys, jetllm; light = 'nats' not in sys.modules and 'msgspec' not in sys.modules; "
        "from jetllm import Client; from jetllm.producer import Client as C; print(light, Client is C)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.split()
    assert out == ["True", "True"]


def test_lora_push_of_an_unusable_directory_says_why_in_one_line(nats_url, tmp_path):
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    r = jetllm("lora", "push", str(tmp_path), "--name", "a", "--nats", nats_url, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "error: the adapter lacks adapter_config.json, adapter_model.safetensors "
        "(found adapter_model.bin: pickle formats are refused, convert to safetensors)"
    ]


@pytest.mark.vllm
def test_generate_streams_text(shared_vllm, nats_url):
    r = jetllm(
        "generate",
        "--nats",
        nats_url,
        "--namespace",
        shared_vllm.namespace,
        "--chat",
        "Hello there",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
    )
    assert r.returncode == 0, r.stderr
    assert "[length; prompt" in r.stderr and "completion 8" in r.stderr
    assert r.stdout.strip() != ""


@pytest.mark.vllm
def test_generate_reports_a_rejected_request(shared_vllm, nats_url):
    r = jetllm(
        "generate",
        "--nats",
        nats_url,
        "--namespace",
        shared_vllm.namespace,
        "--tokens",
        "5,6",
        "--max-tokens",
        "100000",
    )
    assert r.returncode == 1
    assert "context_length_exceeded" in r.stderr and "512" in r.stderr


def test_generate_refuses_an_invalid_request_before_sending(nats_url):
    r = jetllm("generate", "--nats", nats_url, "hi", "--max-tokens", "-3")
    assert r.returncode == 2 and "max_tokens" in r.stderr


@pytest.mark.parametrize("value", ["900", "0", "nan"])
def test_health_refuses_a_stall_timeout_workers_would_refuse(nats_url, value):
    """Else a liveness probe given one would report every worker as failing."""
    r = jetllm("health", "--nats", nats_url, "--stall-timeout", value)
    assert r.returncode == 2 and "--stall-timeout" in r.stderr and "$.stall_timeout" in r.stderr


@pytest.mark.vllm
def test_batch_writes_one_result_per_line_in_input_order(shared_vllm, nats_url, tmp_path):
    lines = [
        {"id": "a", "prompt": "Hello", "max_tokens": 5, "temperature": 0},
        {
            "id": "b",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 30,
            "stop": {"ignore_eos": True},
        },
        "not json at all",
        {"id": "c", "token_ids": [5, 6, 7], "max_tokens": 3},
        {"id": "d", "prompt": "x", "max_tokens": 0},
        {"id": "e", "token_ids": [9, 9], "max_tokens": 1},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) if isinstance(x, dict) else x for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    r = jetllm(
        "batch",
        "--nats",
        nats_url,
        "--namespace",
        shared_vllm.namespace,
        "--model",
        TINY,
        str(src),
        "-o",
        str(out),
        "--concurrency",
        "3",
    )
    assert r.returncode == 1, r.stderr  # two bad lines
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["line"] for x in results] == [1, 2, 3, 4, 5, 6]
    assert [x["id"] for x in results] == ["a", "b", None, "c", "d", "e"]
    assert [len(x["token_ids"]) for x in results] == [5, 30, 0, 3, 0, 1]
    assert results[2]["error"]["code"] == "malformed"
    assert results[4]["error"]["code"] == "invalid_request" and results[4]["error"]["field"] == "$.max_tokens"
    assert "6 lines, 2 errors" in r.stderr


@pytest.mark.vllm
def test_demo_runs_the_whole_path():
    r = jetllm("demo", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("line ") == 8
    assert "8 lines, 1 errors" in r.stderr and "worker stopped (exit code 0)" in r.stderr


def test_fleet_commands_name_an_instance_that_does_not_answer(nats_url, namespace):
    for args in (
        ["health", "--instance", "gone-1", "--timeout", "2"],
        ["ctl", "wake", "--instance", "gone-1"],
        ["tasks", "--instance", "gone-1"],
    ):
        out = jetllm(*args, "--nats", nats_url, "--namespace", namespace, timeout=60)
        assert out.returncode == 1 and "no instance 'gone-1' answers" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    out = jetllm("status", "--nats", nats_url, "--namespace", namespace, timeout=60)
    assert out.returncode == 0 and "(no live instances)" in out.stdout
