"""Build the model its config names and load its safetensors weights (`asyncengine.model_files`
finds the directory and its files)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from asyncengine.distributed.parallel_state import TensorParallelGroup
from asyncengine.model_files import weight_files


def _iter_safetensors(model_path: str) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) per checkpoint tensor: the model reads only the part it holds."""
    from safetensors import safe_open

    for file in weight_files(model_path):
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
