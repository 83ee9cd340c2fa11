"""Streaming three prompts at once through one `AsyncLLMEngine`.

The founding article's third snippet: vLLM code with only the imports changed. The three
requests run in the same steps (continuous batching); each prints what each step added. The
model is a Hugging Face hub id, fetched where a network exists; pass a local directory instead:

    python examples/async_streaming.py [MODEL]
"""

import asyncio
import sys

from asyncengine.engine.arg_utils import AsyncEngineArgs
from asyncengine.engine.async_llm_engine import AsyncLLMEngine
from asyncengine.sampling_params import SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else "TinyLlama/TinyLlama-1.1B-Chat-v1.0"

engine_args = AsyncEngineArgs(model=model, gpu_memory_utilization=0.9)
engine = AsyncLLMEngine.from_engine_args(engine_args)


async def stream(prompt: str, request_id: str) -> None:
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64)
    previous = ""
    async for output in engine.generate(prompt, sampling_params, request_id):
        text = output.outputs[0].text
        if text != previous:  # a step may add only part of a character: nothing to show yet
            print(f"{request_id}: {text[len(previous) :]!r}", flush=True)
        previous = text
        if output.finished:
            print(f"{request_id} finished ({output.outputs[0].finish_reason}): {text!r}")


async def main() -> None:
    prompts = [
        "Hello, my name is",
        "The capital of France is",
        "The future of AI is",
    ]
    await asyncio.gather(*(stream(p, f"request-{i}") for i, p in enumerate(prompts)))


asyncio.run(main())
