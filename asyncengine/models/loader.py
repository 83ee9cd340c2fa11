"""Find a model directory, read its config, build the model and load its safetensors weights."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asyncengine.distributed.parallel_state import TensorParallelGroup


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

        return snapshot_download(
            model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
        )
    except Exception as exc:  # offline, unknown id, gated repo: all end the same way
        raise ValueError(
            f"model {model!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub ({type(exc).__name__}: {exc})"
        ) from exc


def load_hf_config(model_path: str) -> Any:
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ValueError(f"model directory {model_path!r} has no config.json")
    return AutoConfig.from_pretrained(model_path)


def _iter_safetensors(model_path: str) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) per checkpoint tensor: the model reads only the part it holds."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_path!r} has no *.safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_slice(name)


def get_model(model_config: Any, device: str, tp: TensorParallelGroup | None = None) -> nn.Module:
    """Build the model named by the config's architecture and load its weights (this rank's
    shard of them under tensor parallelism)."""
    from asyncengine.models.registry import get_model_class

    hf_config = model_config.hf_config
    model_cls = get_model_class(model_config.architecture)
    dtype = getattr(torch, model_config.dtype)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(hf_config, tp=tp)
    finally:
        torch.set_default_dtype(default_dtype)
    model.load_weights(_iter_safetensors(model_config.model))  # type: ignore[operator]
    return model.eval()
