"""A model's files: find its directory (local, or fetched from the Hugging Face hub) and read
its config.json.

Below the config and the model code, and never imports torch itself, so `config.py` can derive
an `EngineConfig` without importing `asyncengine.models` (transformers' config classes import
torch on their own where it is installed).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# what a model directory needs from the hub: its configs, weights and tokenizer files
HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]


def resolve_model_path(model: str) -> str:
    """A local directory as is; else a Hugging Face hub id, fetched when a network exists."""
    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise ValueError(f"model {model!r} is a file; pass a directory with config.json")
    if model.startswith(("/", "./", "../", "~")):
        raise ValueError(f"model {model!r} is not a local directory")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, allow_patterns=HUB_FILE_PATTERNS)
    except Exception as exc:  # offline, unknown id, gated repo: all end the same way
        raise ValueError(
            f"model {model!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub ({type(exc).__name__}: {exc})"
        ) from exc


def load_hf_config(model_path: str) -> Any:
    """The `transformers.PretrainedConfig` of a resolved model directory's config.json."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ValueError(f"model directory {model_path!r} has no config.json")
    return AutoConfig.from_pretrained(model_path)


def weight_files(model_path: str) -> list[Path]:
    """The directory's safetensors checkpoint files, in order (one, or the shards)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_path!r} has no *.safetensors weights")
    return files
