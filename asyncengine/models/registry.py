"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

from torch import nn

from asyncengine.models.llama import LlamaForCausalLM

# Mistral, Qwen2 and Qwen3 are Llama with flags the config sets (see models/llama.py).
_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: "
            + ", ".join(supported_architectures())
        ) from None
