"""The benchmark compares engines run on the same arguments: `vllm serve` (the openai target) must
get from its own command line what the worker gets from workers/engine/args.py."""

import pytest

from jetllm.bench.targets import _serve_flag, openai_server_args
from jetllm.workers.engine import EngineOptions
from jetllm.workers.engine.args import engine_args

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    ("key", "value", "flags"),
    [
        ("enable_chunked_prefill", False, ["--no-enable-chunked-prefill"]),
        ("enable_prefix_caching", True, ["--enable-prefix-caching"]),
        ("max_num_batched_tokens", 2048, ["--max-num-batched-tokens", "2048"]),
        ("kv_cache_dtype", "fp8", ["--kv-cache-dtype", "fp8"]),
        ("compilation_config", {"mode": 0}, ["--compilation-config", '{"mode": 0}']),
    ],
)
def test_an_engine_argument_becomes_the_flag_vllm_serve_takes(key, value, flags):
    assert _serve_flag(key, value) == flags


@pytest.mark.parametrize("on_cpu", [True, False])
def test_vllm_serve_parses_the_same_engine_arguments_the_worker_uses(on_cpu, tiny_model):
    from vllm import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    opts = EngineOptions(
        model=str(tiny_model),
        max_model_len=1024,
        dtype="float32",
        max_num_seqs=64,
        extra={"enable_prefix_caching": False, "max_num_batched_tokens": 4096},
    )
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(openai_server_args(opts, 8000, on_cpu))
    served = AsyncEngineArgs.from_cli_args(parsed)
    worker = engine_args(opts)
    names = ("max_model_len", "dtype", "max_num_seqs", "enable_prefix_caching", "max_num_batched_tokens")
    assert {n: getattr(served, n) for n in names} == {n: getattr(worker, n) for n in names}
    # The platform's rule follows the platform asked for: whole prompts on CPU, vLLM's default elsewhere.
    assert served.enable_chunked_prefill is (False if on_cpu else AsyncEngineArgs.enable_chunked_prefill)
    if on_cpu:
        assert worker.enable_chunked_prefill is False  # this box is a CPU one: the worker's own rule
