"""The adapter a request runs with, named as vLLM names it (`vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory under a name and an id of the caller's choosing.

    `lora_int_id` is the adapter's key in the engine (>= 1; 0 means the base model);
    `lora_name` is what front ends call it (an OpenAI `model`).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
