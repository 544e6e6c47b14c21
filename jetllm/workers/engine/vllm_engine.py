"""The vLLM `AsyncLLM` behind the Engine protocol: start-up, prompt rendering, sampling, outputs."""

from __future__ import annotations

import functools
import gc
import logging
import shutil
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import anyio
import msgspec

from ... import reaper
from ...errors import EngineDead, EngineRequestError, RequestRejected
from ...schemas import (
    ChatPrompt,
    ErrorCode,
    GenerateRequest,
    GrammarOutput,
    Prompt,
    TextPrompt,
    TokensPrompt,
)
from . import vllm_convert
from .args import engine_args, kv_sockets_dir
from .base import (
    EngineAdapter,
    EngineLoad,
    EnginePrompt,
    EngineStep,
    PromptEmbeds,
)
from .chatmessages import template_message
from .facts import engine_facts
from .grammarcheck import GrammarCheck
from .options import EngineOptions
from .prompttail import TailChoices, leaked_text
from .sampling import build_sampling_params, field_of_error

log = logging.getLogger(__name__)

ENGINE_TEARDOWN_TIMEOUT = 1.0
"""Seconds vLLM's processes get to exit once the worker has settled every job, before they are
killed. vLLM waits 5 s by default, and on these machines spends them all: its model-runner
process takes ~4 s to exit and the engine core is killed anyway. Nothing the worker needs is
lost by ending them sooner, and a rolling restart moves on 4 s earlier per worker."""


class _LoadRecorder:
    """Keeps each engine's (data-parallel rank's) latest scheduler figures (a vLLM stat logger)."""

    def __init__(self) -> None:
        self.ranks: dict[int, EngineLoad] = {}

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        ranks = self.ranks

        class Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                ranks.setdefault(engine_index, EngineLoad())

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if scheduler_stats is not None:
                    ranks[engine_idx] = EngineLoad(
                        running=scheduler_stats.num_running_reqs,
                        waiting=scheduler_stats.num_waiting_reqs,
                        kv_usage=scheduler_stats.kv_cache_usage,
                    )

            def log_engine_initialized(self) -> None:
                pass

        return Logger(vllm_config, engine_index)


def _unexported() -> type:
    """vLLM's Prometheus stat logger doing nothing. vLLM adds its own unless one of the loggers it
    is given is one; the worker's load recorder needs the engine's statistics, so they stay on."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class Unexported(PrometheusStatLogger):
        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            pass

        def record(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record_admission_rejection(self, reason: str) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
            pass

    return Unexported


class VllmEngine:
    """One AsyncLLM. Build it with `await VllmEngine.start(opts)` inside the worker's event loop."""

    def __init__(
        self, llm: Any, opts: EngineOptions, recorder: _LoadRecorder, kv_dir: str | None = None
    ) -> None:
        self.llm = llm
        self._recorder = recorder
        self._kv_dir = kv_dir
        self._asleep_level: int | None = None
        self._adapters: dict[int, EngineAdapter] = {}
        """The adapters the engine holds, to add again after a level-2 wake."""
        self.facts = engine_facts(llm, opts.name, opts.model)
        self._defaults = llm.model_config.get_diff_sampling_param()
        self._decode = vllm_convert.fast_decode(llm)
        self._grammars: GrammarCheck | None = None
        if llm.vllm_config.structured_outputs_config.backend == "guidance":
            self._grammars = GrammarCheck(llm.get_tokenizer(), self.facts.vocab_size)

    @classmethod
    async def start(cls, opts: EngineOptions) -> VllmEngine:
        """Start the engine (blocks the loop for its start-up, ~15 s for a tiny model on CPU)."""
        kv_dir = kv_sockets_dir() if opts.kv_events else None
        try:
            args = engine_args(opts, kv_dir)
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.async_llm import AsyncLLM

            recorder = _LoadRecorder()
            before = reaper.descendants()
            loggers = [recorder.factory] if opts.engine_metrics else [recorder.factory, _unexported()]
            llm = AsyncLLM.from_engine_args(
                args, usage_context=UsageContext.ENGINE_CONTEXT, stat_loggers=loggers
            )
            reaper.watch(reaper.descendants() - before)
            # vLLM's engine processes cache their environment once started; its front end, which
            # lives in this process, otherwise reads os.environ for every output of every step.
            from vllm import envs as vllm_envs

            vllm_envs.enable_envs_cache()
            # Everything loaded so far (vLLM, torch, the tokenizer) lives as long as the process:
            # exempt it from the collector, as `vllm serve` does once it is up (decisions.md).
            gc.collect()
            gc.freeze()
        except BaseException:
            if kv_dir:
                shutil.rmtree(kv_dir, ignore_errors=True)
            raise
        return cls(llm, opts, recorder, kv_dir)

    async def render(self, prompt: Prompt) -> list[int]:
        from vllm.exceptions import VLLMValidationError

        if isinstance(prompt, TokensPrompt):
            return list(prompt.token_ids)
        try:
            if isinstance(prompt, ChatPrompt):
                from vllm.renderers.params import ChatParams

                kwargs = dict(prompt.template_kwargs or {})
                kwargs["add_generation_prompt"] = prompt.add_generation_prompt
                kwargs["continue_final_message"] = prompt.continue_final_message
                if prompt.tools:
                    kwargs["tools"] = msgspec.to_builtins(prompt.tools)
                messages = [template_message(m) for m in prompt.messages]
                _, (rendered,) = await self.llm.renderer.render_chat_async(
                    [messages], ChatParams(chat_template_kwargs=kwargs)
                )
            elif isinstance(prompt, TextPrompt):
                (rendered,) = await self.llm.renderer.render_cmpl_async([{"prompt": prompt.text}])
            else:  # pragma: no cover - the union is closed
                raise RequestRejected(ErrorCode.INVALID_REQUEST, f"unknown prompt type {type(prompt)}")
        except VLLMValidationError as exc:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, str(exc), field="$.prompt") from None
        except RequestRejected:
            raise
        except Exception as exc:  # templates and tokenizers raise many kinds of errors
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST,
                f"cannot render the prompt: {type(exc).__name__}: {exc}",
                field="$.prompt",
            ) from None
        return list(rendered["prompt_token_ids"])

    async def generate(
        self,
        req: GenerateRequest,
        prompt_ids: EnginePrompt,
        max_tokens: int,
        adapter: EngineAdapter | None = None,
        kv_transfer: dict[str, Any] | None = None,
    ) -> AsyncGenerator[EngineStep, None]:
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import tokens_input
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        params = build_sampling_params(req, max_tokens, self._defaults)
        if self._grammars is not None and isinstance(req.structured, GrammarOutput):
            await anyio.to_thread.run_sync(self._grammars.check, req.structured)
        if kv_transfer:
            params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": dict(kv_transfer)}
        want_text = (
            req.output.text
            if req.output.text is not None
            else isinstance(req.prompt, (ChatPrompt, TextPrompt))
        )
        rid = req.request_id
        engine_input = (
            vllm_convert.embeds_of(prompt_ids)
            if isinstance(prompt_ids, PromptEmbeds)
            else tokens_input(prompt_ids)
        )
        lora = vllm_convert.lora_request(adapter)
        constrained, produced = req.structured is not None, False
        tails = self._tails(prompt_ids, params, want_text)
        try:
            async for out in self.llm.generate(engine_input, params, rid, lora_request=lora):
                step = vllm_convert.step_of(out, want_text or tails is not None)
                if tails is not None:
                    step = tails.repair(step)
                    if tails.done and not step.finished:
                        await self.llm.abort(rid)
                        yield step
                        return
                if constrained and not produced:
                    produced = any(c.token_ids for c in step.choices)
                    if not produced and any(c.finish_reason == "error" for c in step.choices):
                        raise vllm_convert.uncompiled(req)
                yield step
        except EngineDeadError:
            raise EngineDead("the vLLM engine died") from None
        except VLLMValidationError as exc:
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST,
                str(exc),
                field=field_of_error(req, getattr(exc, "parameter", None), str(exc)),
            ) from None
        except EngineGenerateError as exc:
            cause = exc.__cause__
            raise EngineRequestError(
                f"the engine failed this request: {type(cause).__name__ if cause else 'error'}: {cause or exc}"
            ) from None
        except BaseException:
            # vLLM aborts on cancellation itself, but its abort can be cut short by a repeated
            # cancel; a shielded second abort makes sure the engine stops computing.
            with anyio.CancelScope(shield=True):
                try:
                    await self.llm.abort(rid)
                except Exception:
                    pass
            raise

    def _tails(self, prompt_ids: EnginePrompt, params: Any, want_text: bool) -> TailChoices | None:
        """The repair for a token prompt that ends inside a character (prompttail.py); the
        engine then runs without stop strings, which the repair applies."""
        if self._decode is None or isinstance(prompt_ids, PromptEmbeds) or not (want_text or params.stop):
            return None
        skip = params.skip_special_tokens
        leaked = leaked_text(lambda ids: self._decode(ids, skip_special_tokens=skip), prompt_ids)
        if leaked is None:
            return None
        stop, params.stop = list(params.stop or ()), None
        if stop:
            params.stream_interval = None  # one token an output, unless vLLM merges outputs

        def text_of(generated: Sequence[int]) -> str:
            return self._decode(list(prompt_ids) + list(generated), skip_special_tokens=skip)[len(leaked) :]

        return TailChoices(
            leaked,
            params.n,
            stop,
            params.include_stop_str_in_output,
            params.min_tokens,
            want_text,
            text_of if stop else None,
        )

    async def check_health(self) -> None:
        try:
            await self.llm.check_health()
        except Exception as exc:
            raise EngineDead(f"engine health check failed: {type(exc).__name__}: {exc}") from None

    def load(self) -> EngineLoad:
        ranks = list(self._recorder.ranks.values())
        usage = [r.kv_usage for r in ranks if r.kv_usage is not None]
        return EngineLoad(
            running=sum(r.running for r in ranks),
            waiting=sum(r.waiting for r in ranks),
            unfinished=self.llm.get_num_unfinished_requests(),
            kv_usage=sum(usage) / len(usage) if usage else None,
        )

    def load_by_rank(self) -> dict[int, EngineLoad]:
        return dict(self._recorder.ranks)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.llm.reset_prefix_cache())

    async def sleep(self, level: int) -> str:
        if self.llm.vllm_config.model_config.enable_sleep_mode:
            await self.llm.sleep(level, mode="wait")
            self._asleep_level = level
            if level == 1:
                return "engine asleep at level 1: weights moved to CPU memory, KV cache discarded"
            return "engine asleep at level 2: weights and KV cache discarded (wake reloads the weights)"
        # Without sleep mode (always the case on CPU, where vLLM refuses it) nothing can be
        # released: pause the scheduler, keep the cache, and say so.
        await self.llm.pause_generation(mode="wait", clear_cache=False)
        return "scheduling paused; no memory freed (this engine runs without sleep mode, e.g. on CPU)"

    async def wake(self) -> None:
        if not self.llm.vllm_config.model_config.enable_sleep_mode:
            await self.llm.resume_generation()
            return
        if self._asleep_level == 2:
            await self._wake_from_level_2()
        else:
            await self.llm.wake_up()
        self._asleep_level = None

    async def _wake_from_level_2(self) -> None:
        """Level 2 discarded the weights, and waking maps their memory back empty: vLLM's way
        back is weights memory first, then the weights read again from the model's files, then
        the KV cache (its memory is only taken once the weights are in). Reloading drops every
        LoRA adapter from the engine, so the ones it held are added again. A failure on the way
        leaves the engine asleep; every step can be repeated, so a later wake starts over."""
        await self.llm.wake_up(tags=["weights"])
        await self.llm.collective_rpc("reload_weights")
        if await self.llm.wake_up(tags=["kv_cache"]) is False:
            raise EngineRequestError("the engine is still partly asleep after waking weights and KV cache")
        for adapter in list(self._adapters.values()):
            try:
                await self.llm.add_lora(vllm_convert.lora_request(adapter))
            except Exception as exc:  # vLLM loads it again on the first request that names it
                log.warning("adapter %s not added back after waking: %s", adapter.name, exc)

    async def add_adapter(self, adapter: EngineAdapter) -> None:
        try:
            ok = await self.llm.add_lora(vllm_convert.lora_request(adapter))
        except Exception as exc:  # vLLM refuses with plain exceptions; the engine survives them
            raise EngineRequestError(f"the engine refused the adapter: {exc}") from None
        if not ok:
            raise EngineRequestError("the engine refused the adapter")
        self._adapters[adapter.id] = adapter

    async def remove_adapter(self, adapter_id: int) -> None:
        await self.llm.remove_lora(adapter_id)
        self._adapters.pop(adapter_id, None)

    async def close(self) -> None:
        try:
            await anyio.to_thread.run_sync(
                functools.partial(self.llm.shutdown, timeout=ENGINE_TEARDOWN_TIMEOUT)
            )
        finally:
            if self._kv_dir:
                shutil.rmtree(self._kv_dir, ignore_errors=True)
