"""VllmEngine's sleep and wake against a stand-in for vLLM's AsyncLLM that records the calls.

Sleep mode needs a GPU, which tests do not have; the order of the calls is what jetllm decides,
so it is checked here: level 1 wakes in one call, level 2 wakes the weights' memory, reloads the
weights into it, wakes the KV cache, and adds back the adapters the reload dropped (vLLM's
documented way back from level 2). Without sleep mode (CPU) sleep and wake only pause scheduling.
The CPU path against real vLLM is in test_vllm_fleet.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jetllm.errors import EngineRequestError
from jetllm.workers.engine import EngineAdapter

pytest.importorskip("vllm")

from jetllm.workers.engine.vllm_engine import VllmEngine, _LoadRecorder  # noqa: E402

pytestmark = pytest.mark.anyio


class FakeAsyncLLM:
    """The parts of AsyncLLM that VllmEngine touches for sleep, wake and adapters."""

    def __init__(self, sleep_mode: bool, fail: str | None = None) -> None:
        self.calls: list[tuple] = []
        self.fail = fail
        hf = SimpleNamespace(eos_token_id=2)
        self.model_config = SimpleNamespace(
            enable_sleep_mode=sleep_mode,
            max_model_len=64,
            hf_config=hf,
            enable_prompt_embeds=False,
            get_vocab_size=lambda: 100,
            get_diff_sampling_param=dict,
            get_hidden_size=lambda: 8,
        )
        self.vllm_config = SimpleNamespace(
            model_config=self.model_config,
            lora_config=None,
            cache_config=SimpleNamespace(
                block_size=16,
                num_gpu_blocks=10,
                enable_prefix_caching=True,
                prefix_caching_hash_algo="sha256",
            ),
            scheduler_config=SimpleNamespace(max_num_seqs=4),
            parallel_config=SimpleNamespace(data_parallel_size=1),
            structured_outputs_config=SimpleNamespace(backend="xgrammar"),
        )

    def _record(self, *call) -> None:
        self.calls.append(call)
        if call[0] == self.fail:
            raise RuntimeError(f"{call[0]} failed")

    def get_tokenizer(self):
        return SimpleNamespace(eos_token_id=2, chat_template=None)

    def get_kv_event_sources(self) -> dict:
        return {}

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self._record("sleep", level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self._record("wake_up", tags)
        return tags != ["weights"]  # fully awake once nothing is left asleep

    async def collective_rpc(self, method: str, timeout=None, args=(), kwargs=None) -> list:
        self._record("collective_rpc", method)
        return [None]

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self._record("pause_generation", mode, clear_cache)

    async def resume_generation(self) -> None:
        self._record("resume_generation")

    async def add_lora(self, lora) -> bool:
        self._record("add_lora", lora.lora_name, lora.lora_int_id)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self._record("remove_lora", lora_id)
        return True


def engine(llm: FakeAsyncLLM) -> VllmEngine:
    from jetllm.workers.engine.options import EngineOptions

    return VllmEngine(llm, EngineOptions(model="m"), _LoadRecorder())


async def test_level_1_wakes_in_one_call():
    llm = FakeAsyncLLM(sleep_mode=True)
    e = engine(llm)
    detail = await e.sleep(1)
    await e.wake()
    assert llm.calls == [("sleep", 1, "wait"), ("wake_up", None)]
    assert detail == "engine asleep at level 1: weights moved to CPU memory, KV cache discarded"


async def test_level_2_wake_reloads_the_weights_before_the_kv_cache_and_adds_adapters_back():
    llm = FakeAsyncLLM(sleep_mode=True)
    e = engine(llm)
    await e.add_adapter(EngineAdapter(name="a", id=1, path="/a"))
    await e.add_adapter(EngineAdapter(name="b", id=2, path="/b"))
    await e.remove_adapter(1)
    llm.calls.clear()
    detail = await e.sleep(2)
    await e.wake()
    assert llm.calls == [
        ("sleep", 2, "wait"),
        ("wake_up", ["weights"]),
        ("collective_rpc", "reload_weights"),
        ("wake_up", ["kv_cache"]),
        ("add_lora", "b", 2),
    ]
    assert "weights and KV cache discarded" in detail
    llm.calls.clear()
    await e.sleep(1)  # the next sleep is a level-1 one: no reload on waking from it
    await e.wake()
    assert llm.calls == [("sleep", 1, "wait"), ("wake_up", None)]


async def test_a_level_2_wake_that_fails_can_be_repeated_from_the_start():
    llm = FakeAsyncLLM(sleep_mode=True, fail="collective_rpc")
    e = engine(llm)
    await e.sleep(2)
    with pytest.raises(RuntimeError, match="collective_rpc failed"):
        await e.wake()
    llm.fail = None
    llm.calls.clear()
    await e.wake()
    assert llm.calls == [
        ("wake_up", ["weights"]),
        ("collective_rpc", "reload_weights"),
        ("wake_up", ["kv_cache"]),
    ]


async def test_a_wake_that_leaves_the_engine_partly_asleep_fails():
    llm = FakeAsyncLLM(sleep_mode=True)

    async def never_fully(tags=None) -> bool:
        llm.calls.append(("wake_up", tags))
        return False

    llm.wake_up = never_fully
    e = engine(llm)
    await e.sleep(2)
    with pytest.raises(EngineRequestError, match="still partly asleep"):
        await e.wake()


@pytest.mark.parametrize("level", [1, 2])
async def test_without_sleep_mode_sleep_and_wake_only_pause_scheduling(level):
    llm = FakeAsyncLLM(sleep_mode=False)
    e = engine(llm)
    detail = await e.sleep(level)
    await e.wake()
    assert llm.calls == [("pause_generation", "wait", False), ("resume_generation",)]
    assert "no memory freed" in detail
