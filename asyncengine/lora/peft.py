"""Read and check a PEFT LoRA adapter: `adapter_config.json` + `adapter_model.safetensors`.

PEFT's layer computes `base(x) + lora_B(lora_A(x)) * scaling`, with `scaling = lora_alpha / r`
(`lora_alpha / sqrt(r)` under rsLoRA), r being each module's own rank (`rank_pattern` may set
it per module; the tensors' shapes say what it is). Anything PEFT can express that this engine
does not compute (DoRA, trained biases, extra modules, alpha patterns, other layers) is refused
at load with an `InvalidRequestError` naming it, never run wrong.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncengine.errors import InvalidRequestError
from asyncengine.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the projections an adapter may target, by their Hugging Face names
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAModule:
    """One projection's low-rank update: delta(x) = scaling * (x @ a.T) @ b.T."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAWeights:
    """An adapter loaded in host memory: its modules by (layer index, module name)."""

    lora_int_id: int
    modules: dict[tuple[int, str], LoRAModule] = field(default_factory=dict)


def load_adapter(
    lora_request: LoRARequest, hf_config: Any, max_lora_rank: int, dtype: torch.dtype
) -> LoRAWeights:
    """Read and check the adapter at `lora_request.lora_path` for the model `hf_config`
    describes; its tensors come back in `dtype` on the CPU."""
    _check_request(lora_request)
    directory = Path(lora_request.lora_path)
    peft_config = _read_config(directory)
    scaling_of = _scaling_rule(peft_config)
    shapes = _module_shapes(hf_config)
    tensors = _read_tensors(directory)
    weights = LoRAWeights(lora_request.lora_int_id)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.search(name)
        if match is None:
            raise _invalid("lora_path", f"{WEIGHTS_FILE} holds {name!r}, not a supported module")
        layer, module, part = int(match[1]), match[2], match[3]
        pairs.setdefault((layer, module), {})[part] = tensor
    _check_modules({module for _, module in pairs})
    for (layer, module), pair in sorted(pairs.items()):
        if layer >= hf_config.num_hidden_layers or set(pair) != {"A", "B"}:
            raise _invalid("lora_path", f"layer {layer} {module}: lora_A and lora_B expected")
        a, b = pair["A"], pair["B"]
        out_features, in_features = shapes[module]
        rank = a.shape[0]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise _invalid(
                "lora_path",
                f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                f"do not fit the model's [{out_features}, {in_features}] projection",
            )
        if rank > max_lora_rank:
            raise _invalid("lora_path", f"rank {rank} exceeds max_lora_rank ({max_lora_rank})")
        weights.modules[(layer, module)] = LoRAModule(
            a.to(dtype).contiguous(), b.to(dtype).contiguous(), scaling_of(rank)
        )
    return weights


def _check_request(lora_request: LoRARequest) -> None:
    if not isinstance(lora_request.lora_int_id, int) or lora_request.lora_int_id < 1:
        raise _invalid("lora_int_id", f"must be an int >= 1, got {lora_request.lora_int_id!r}")
    if not lora_request.lora_name:
        raise _invalid("lora_name", "must be a non-empty string")


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise _invalid("lora_path", f"{str(directory)!r} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise _invalid("lora_path", f"{CONFIG_FILE} cannot be read: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise _invalid("lora_path", f"peft_type {config.get('peft_type')!r} is not LORA")
    refused = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    if any(refused.values()):
        names = ", ".join(name for name, is_set in refused.items() if is_set)
        raise _invalid("lora_path", f"{CONFIG_FILE} sets what is not supported: {names}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        _check_modules(set(targets))
    return config


def _scaling_rule(config: dict[str, Any]) -> Callable[[int], float]:
    """A module's scaling from its rank."""
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    if config.get("use_rslora"):
        return lambda rank: alpha / math.sqrt(rank)
    return lambda rank: alpha / rank


def _check_modules(modules: set[str]) -> None:
    unsupported = sorted(modules - set(SUPPORTED_MODULES))
    if unsupported:
        raise _invalid(
            "lora_path",
            f"targets modules the engine does not support: {', '.join(unsupported)} "
            f"(supported: {', '.join(SUPPORTED_MODULES)})",
        )


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise _invalid("lora_path", f"{str(directory)!r} has no {WEIGHTS_FILE}")
    try:
        return load_file(str(path))
    except Exception as exc:  # a truncated or foreign file
        raise _invalid("lora_path", f"{WEIGHTS_FILE} cannot be read: {exc}") from None


def _module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """[out, in] of each supported projection of the whole (unsharded) model."""
    hidden = hf_config.hidden_size
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // num_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    inter = hf_config.intermediate_size
    return {
        "q_proj": (num_heads * head_dim, hidden),
        "k_proj": (num_kv_heads * head_dim, hidden),
        "v_proj": (num_kv_heads * head_dim, hidden),
        "o_proj": (hidden, num_heads * head_dim),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def _invalid(field: str, description: str) -> InvalidRequestError:
    return InvalidRequestError(f"lora_request.{field}", description)
