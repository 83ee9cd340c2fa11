"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) with paged attention inside.

One implementation; the families differ only in flags read from the config: qkv bias (Qwen2),
per-head q/k RMSNorm (Qwen3), sliding-window layers (Mistral, some Qwen), rope scaling (Llama 3).
Projections are fused (qkv, gate+up) so each layer does fewer, larger matmuls.

With tensor parallelism (`tp`), each rank holds a Megatron shard: its query heads and their KV
heads (replicated when there are fewer KV heads than ranks), its share of the MLP, and its
rows of the vocabulary (models/tp_layers.py); the KV cache then holds only its KV heads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.distributed.parallel_state import TensorParallelGroup
from asyncengine.lora.layers import add_lora, has_lora
from asyncengine.models.tp_layers import (
    Shard,
    WeightSource,
    lm_head,
    row_parallel_linear,
    vocab_parallel_embedding,
    vocab_shard,
)
from asyncengine.worker import cpu_ops
from asyncengine.worker.attention import Attention
from asyncengine.worker.cpu_linear import PackedLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._runs_on_cpu_op(x):
            return cpu_ops.rms_norm(x, self.weight, self.eps)  # the same math in one pass
        # statistics in float32 whatever the dtype, as transformers does
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_then_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of `residual + x`, `residual + x`): a decoder's residual add and the norm
        after it. On the CPU op it is one pass, and the sum is written into `residual`."""
        if self._runs_on_cpu_op(x) and residual.is_contiguous() and residual.dtype == x.dtype:
            return cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self(residual), residual

    def _runs_on_cpu_op(self, x: torch.Tensor) -> bool:
        return (
            x.is_cpu
            and x.dim() == 2
            and x.is_contiguous()
            and x.dtype == self.weight.dtype
            and cpu_ops.is_loaded()
        )


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout) with the config's scaling applied."""

    def __init__(self, config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        inv_freq, scaling = _rope_inv_freq(config, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, heads, head_dim]
        if x.is_cpu and x.stride(-1) == 1 and positions.dtype == torch.long and cpu_ops.is_loaded():
            return cpu_ops.rotary_embedding_(x, positions, self.cos, self.sin)  # in place
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rope_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"rope_type {rope_type!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary: RotaryEmbedding,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.num_heads: int
        self.num_kv_heads: int
        first_head, self.num_heads = (0, total_heads) if tp is None else tp.split(total_heads)
        first_kv, self.num_kv_heads = (
            (0, total_kv_heads) if tp is None else tp.kv_heads(total_kv_heads)
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # the checkpoint rows (q, k, v) and o_proj columns of this rank's heads
        self.q_shard = Shard(0, first_head * self.head_dim, self.q_size)
        self.kv_shard = Shard(0, first_kv * self.head_dim, self.kv_size)
        self.o_shard = Shard(1, first_head * self.head_dim, self.q_size)
        has_bias = bool(getattr(config, "attention_bias", False)) or _family(config) == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=has_bias)
        o_bias = bool(getattr(config, "attention_bias", False)) and _family(config) != "qwen2"
        self.o_proj = row_parallel_linear(
            total_heads * self.head_dim, config.hidden_size, o_bias, tp
        )
        self.has_qk_norm = _family(config) == "qwen3"
        if self.has_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(
            layer_idx,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            _sliding_window(config, layer_idx),
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = add_lora(self.qkv_proj(hidden), hidden, self.layer_idx, "qkv_proj")
        q_and_k, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = q_and_k.split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
            q, k = self.rotary(positions, q), self.rotary(positions, k)
        else:  # q's heads and k's, side by side in each row: rotated in one call
            heads = q_and_k.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = self.rotary(positions, heads).split([self.num_heads, self.num_kv_heads], 1)
        out = self.attn(q, k, v).reshape(-1, self.q_size)
        return add_lora(self.o_proj(out), out, self.layer_idx, "o_proj")


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, layer_idx: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        bias = bool(getattr(config, "mlp_bias", False))
        total = config.intermediate_size
        self.intermediate_size: int
        start, self.intermediate_size = (0, total) if tp is None else tp.split(total)
        # the checkpoint rows (gate, up) and down_proj columns of this rank's share
        self.gate_up_shard = Shard(0, start, self.intermediate_size)
        self.down_shard = Shard(1, start, self.intermediate_size)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = row_parallel_linear(total, config.hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up_proj = self.gate_up_proj
        if isinstance(gate_up_proj, PackedLinear) and gate_up_proj.is_gated and not has_lora():
            hidden = gate_up_proj.silu_and_mul(x)  # the activation in the product's pass
            return add_lora(self.down_proj(hidden), hidden, self.layer_idx, "down_proj")
        gate_up = add_lora(gate_up_proj(x), x, self.layer_idx, "gate_up_proj")
        if gate_up.is_cpu and gate_up.is_contiguous() and cpu_ops.is_loaded():
            hidden = cpu_ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        return add_lora(self.down_proj(hidden), hidden, self.layer_idx, "down_proj")


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, rotary: RotaryEmbedding, tp: TensorParallelGroup | None
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary, tp)
        self.mlp = LlamaMLP(config, layer_idx, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream it is to be added to). As in vLLM, each
        residual add is left to the norm after it (the next layer's first, or the model's
        last), so the two run as one pass; `residual` is None at the first layer."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_then_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm.add_then_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = vocab_parallel_embedding(config.vocab_size, config.hidden_size, tp)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        rotary = RotaryEmbedding(config, head_dim, config.max_position_embeddings)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.add_then_norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """A causal LM over the flattened batch: `forward(input_ids, positions) -> hidden states`.

    Under tensor parallelism `compute_logits` is a collective: every rank calls it with the
    same rows, and the driver (rank 0) gets the whole vocabulary's logits.
    """

    def __init__(self, config: Any, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, tp)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, tp)
        self.vocab_shard = vocab_shard(config.vocab_size, tp)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Copy checkpoint tensors in, fusing q/k/v and gate/up; fail on anything missing.

        Each source is read only where this rank's shard lies (a safetensors slice reads
        just those bytes).
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, source in weights:
            if "rotary_emb" in name:
                continue
            target, offset, shard = self._locate(name)
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            tensor = shard.read(source)
            params[target].data.narrow(0, offset, tensor.shape[0]).copy_(tensor)
            loaded.add(target)
        if getattr(self.config, "tie_word_embeddings", False):
            loaded.add("lm_head.weight")
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")

    def _locate(self, name: str) -> tuple[str, int, Shard]:
        """Our parameter for a checkpoint tensor, the row it starts at there, and the part
        of the checkpoint tensor this rank holds."""
        attn: LlamaAttention = self.model.layers[0].self_attn  # type: ignore[assignment]
        mlp: LlamaMLP = self.model.layers[0].mlp  # type: ignore[assignment]
        fused = {
            "q_proj": ("qkv_proj", 0, attn.q_shard),
            "k_proj": ("qkv_proj", attn.q_size, attn.kv_shard),
            "v_proj": ("qkv_proj", attn.q_size + attn.kv_size, attn.kv_shard),
            "gate_proj": ("gate_up_proj", 0, mlp.gate_up_shard),
            "up_proj": ("gate_up_proj", mlp.intermediate_size, mlp.gate_up_shard),
        }
        for hf_name, (target, offset, shard) in fused.items():
            if f".{hf_name}." in name:
                return name.replace(hf_name, target), offset, shard
        if name.endswith("o_proj.weight"):
            return name, 0, attn.o_shard
        if name.endswith("down_proj.weight"):
            return name, 0, mlp.down_shard
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return name, 0, self.vocab_shard
        return name, 0, Shard()


def _family(config: Any) -> str:
    return str(getattr(config, "model_type", "llama"))


def _sliding_window(config: Any, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    if _family(config).startswith("qwen") and not getattr(config, "use_sliding_window", False):
        return None
    return int(window)
