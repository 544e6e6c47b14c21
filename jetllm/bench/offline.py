"""vLLM's offline `LLM.generate`, the reference of `jetllm bench-batch`, in a child process that
keeps its engine up between rounds, so its rounds can take turns with the batch API's. The child
reads the prompts, warms up, then runs one timed round per command; vLLM prints to the same
stdout, so the child's own lines carry a prefix."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from ..workers.engine import EngineOptions


def _llm_kwargs(opts: EngineOptions) -> dict:
    """The worker's engine arguments as keyword arguments of `vllm.LLM` (those set away from
    vLLM's defaults)."""
    from vllm import EngineArgs

    from ..workers.engine.args import engine_args

    ours = engine_args(opts)
    defaults = EngineArgs(model=opts.model)
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    kw = {n: getattr(ours, n) for n in names if getattr(ours, n) != getattr(defaults, n)}
    kw["model"] = opts.model
    kw.pop("disable_log_stats", None)
    return kw


READY = "jetllm-offline ready"
ROUND = "jetllm-offline round "
"""Prefixes of the child's own lines on stdout, where vLLM may print too."""


def offline(opts_json: str, output_len: int) -> None:
    """The child process's part: vLLM's offline engine, kept up between rounds.

    Reads the prompts as one JSON line, warms up, says READY, then runs one timed round per line
    it reads (`text`: detokenized, as vLLM's default does and as the batch API must, its output
    lines carrying text; `ids`: token ids only) and prints its seconds and output tokens."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    opts = msgspec.json.decode(opts_json, type=EngineOptions)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.stdin.readline())]
    llm = LLM(**_llm_kwargs(opts))

    def timed(detokenize: bool, batch: list[Any] = prompts) -> tuple[float, int]:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, detokenize=detokenize)
        started = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - started, sum(len(o.outputs[0].token_ids) for o in outs)

    timed(True, prompts[:8])
    print(READY, flush=True)
    for line in sys.stdin:
        print(ROUND + json.dumps(timed(line.strip() != "ids")), flush=True)


OFFLINE = "vLLM offline LLM.generate"
OFFLINE_IDS = "vLLM offline LLM.generate, token ids only (detokenize=False)"


class OfflineChild:
    """vLLM's offline `LLM.generate` in a child process, one timed round per call."""

    def __init__(self, opts: EngineOptions, prompts: list[list[int]], output_len: int, log: Path) -> None:
        self._log_path = log
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jetllm.bench.offline",
                msgspec.json.encode(opts).decode(),
                str(output_len),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(prompts) + "\n")  # a thousand prompts exceed argv's limit
            self.proc.stdin.flush()
            self._until(READY)
        except BaseException:  # a failed start (or a Ctrl-C during it) leaves no child behind
            self.proc.kill()
            self.proc.wait()
            self._log.close()
            raise

    def _until(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        raise RuntimeError(f"the offline engine ended ({self.proc.wait()}); see {self._log_path}")

    def round(self, detokenize: bool = True) -> tuple[float, int]:
        """Seconds and output tokens of one `generate` over every prompt."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("text\n" if detokenize else "ids\n")
        self.proc.stdin.flush()
        seconds, tokens = json.loads(self._until(ROUND))
        return float(seconds), int(tokens)

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(60)
        except Exception:
            self.proc.kill()
        self._log.close()

    def __enter__(self) -> OfflineChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    offline(sys.argv[1], int(sys.argv[2]))
