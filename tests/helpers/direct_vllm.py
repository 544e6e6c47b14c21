"""vLLM's AsyncLLM called directly, as a reference to compare jetllm's output against.

Runs as a child process of the test session: one JSON request (or {"batch": [...]}) per stdin
line, one JSON result (or list) per stdout line. Engine arguments are the ones the test workers use.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid

# Results go to the original stdout; everything else printing to fd 1 (vLLM, its child
# processes) is sent to stderr so it cannot corrupt the protocol.
RESULTS = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr


async def one(llm, spec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import tokens_input
    from vllm.renderers.params import ChatParams
    from vllm.sampling_params import RequestOutputKind

    prompt = spec["prompt"]
    if "chat" in prompt:
        _, (engine_input,) = await llm.renderer.render_chat_async(
            [prompt["chat"]], ChatParams(chat_template_kwargs={"add_generation_prompt": True})
        )
    elif "text" in prompt:
        (engine_input,) = await llm.renderer.render_cmpl_async([{"prompt": prompt["text"]}])
    else:
        engine_input = tokens_input(prompt["token_ids"])
    params = SamplingParams(**spec["params"], output_kind=RequestOutputKind.FINAL_ONLY)
    result = None
    try:
        async for o in llm.generate(engine_input, params, uuid.uuid4().hex):
            result = o
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    c = result.outputs[0]
    return {
        "token_ids": list(c.token_ids),
        "text": c.text,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
        "prompt_token_ids": list(result.prompt_token_ids or []),
    }


async def main(model: str) -> None:
    from jetllm.workers.engine import EngineOptions
    from jetllm.workers.engine.vllm_engine import VllmEngine

    engine = await VllmEngine.start(
        EngineOptions(
            model=model, served_model_name="tiny", max_model_len=512, kv_cache_bytes=128 << 20, block_size=32
        )
    )
    RESULTS.write(json.dumps({"ready": True}) + "\n")
    RESULTS.flush()
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        spec = json.loads(line)
        if "batch" in spec:
            reply = await asyncio.gather(*(one(engine.llm, s) for s in spec["batch"]))
        else:
            reply = await one(engine.llm, spec)
        RESULTS.write(json.dumps(reply) + "\n")
        RESULTS.flush()
    await engine.close()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    asyncio.run(main(sys.argv[1]))
