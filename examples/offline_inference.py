"""Offline batch generation with `LLM`, sized by `gpu_memory_utilization`.

The founding article's first snippet: vLLM code with only the import changed. The model is a
Hugging Face hub id, fetched where a network exists; pass a local model directory instead:

    python examples/offline_inference.py [MODEL]
"""

import sys

from asyncengine import LLM, SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else "TinyLlama/TinyLlama-1.1B-Chat-v1.0"

prompts = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=256)

llm = LLM(model=model, gpu_memory_utilization=0.9)
outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
