"""The LoRA deltas of one forward, added to each projection's output per adapter segment.

Each supported projection of each layer has a stack of `max_loras` device slots: A
[slots, max_rank, in] and B [slots, out, max_rank], zero past an adapter's own rank (and
where it does not target the module). A forward's rows are grouped by adapter (the runner
orders them so), and each segment of rows adds `scaling * (x @ A.T) @ B.T` for its slot's
adapter: grouped matmuls over the real rank, never a merged weight.

Under tensor parallelism A and B are sharded as their base layer is: a column-parallel
projection (q, k, v, gate, up) holds the rows of B of its output rows; a row-parallel one
(o, down) holds the columns of A of its input columns, and its partial deltas are summed
over the ranks like its base output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.distributed.parallel_state import TensorParallelGroup
from asyncengine.lora.peft import LoRAWeights
from asyncengine.models.tp_layers import Shard
from asyncengine.worker.forward_context import current_lora


@dataclass(frozen=True)
class _Target:
    """One Hugging Face module inside one of the model's (possibly fused) projections."""

    module: str  # "q_proj"
    offset: int  # its first row in the projection's output
    num_out: int  # its rows there (this rank's)
    num_in: int  # the projection's input columns (this rank's)
    b_rows: Shard  # the rows of the checkpoint's B this rank holds
    a_cols: Shard  # the columns of the checkpoint's A this rank holds


def projection_targets(model: Any) -> dict[str, list[_Target]]:
    """The modules of each LoRA-capable projection of a llama-family model, by projection."""
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    hidden = model.config.hidden_size
    q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
    whole = Shard()
    q_rows, kv_rows = Shard(0, attn.q_shard.start, q), Shard(0, attn.kv_shard.start, kv)
    inter_rows = Shard(0, mlp.gate_up_shard.start, inter)
    return {
        "qkv_proj": [
            _Target("q_proj", 0, q, hidden, q_rows, whole),
            _Target("k_proj", q, kv, hidden, kv_rows, whole),
            _Target("v_proj", q + kv, kv, hidden, kv_rows, whole),
        ],
        "o_proj": [_Target("o_proj", 0, hidden, q, whole, Shard(1, attn.o_shard.start, q))],
        "gate_up_proj": [
            _Target("gate_proj", 0, inter, hidden, inter_rows, whole),
            _Target("up_proj", inter, inter, hidden, inter_rows, whole),
        ],
        "down_proj": [
            _Target("down_proj", 0, hidden, inter, whole, Shard(1, mlp.down_shard.start, inter))
        ],
    }


_ROW_PARALLEL = ("o_proj", "down_proj")


class LoRAStacks:
    """The device slots of every adapter-capable module of the model."""

    def __init__(
        self,
        model: Any,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: str,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        self.targets = projection_targets(model)
        self.tp = tp
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        # each slot's scaling per module (0 where it is not targeted): the kernels read it
        self.scalings: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(len(model.model.layers)):
            for target in (t for group in self.targets.values() for t in group):
                key = (layer, target.module)
                shape_a = (max_loras, max_rank, target.num_in)
                self.a[key] = torch.zeros(shape_a, dtype=dtype, device=device)
                shape_b = (max_loras, target.num_out, max_rank)
                self.b[key] = torch.zeros(shape_b, dtype=dtype, device=device)
                self.scalings[key] = torch.zeros(max_loras, dtype=torch.float32, device=device)
        # per slot: (layer, module) -> (rank, scaling) of what the slot's adapter targets
        self.slot_modules: list[dict[tuple[int, str], tuple[int, float]]] = [
            {} for _ in range(max_loras)
        ]

    def load(self, slot: int, weights: LoRAWeights) -> None:
        """Copy an adapter (this rank's shard of it) into `slot`, replacing what was there."""
        for key in self.slot_modules[slot]:
            self.a[key][slot].zero_()
            self.b[key][slot].zero_()
            self.scalings[key][slot] = 0.0
        targets = {t.module: t for group in self.targets.values() for t in group}
        modules = {}
        for key, lora in weights.modules.items():
            target = targets[key[1]]
            a, b = target.a_cols.read(lora.a), target.b_rows.read(lora.b)
            self.a[key][slot, : lora.rank].copy_(a)
            self.b[key][slot, :, : lora.rank].copy_(b)
            self.scalings[key][slot] = lora.scaling
            modules[key] = (lora.rank, lora.scaling)
        self.slot_modules[slot] = modules


@dataclass
class LoRABatch:
    """Which adapter slot each row of one forward runs with: as runs of rows (grouped
    matmuls), and with `row_slots` (a tensor, -1 for the base model) for the Triton kernels."""

    stacks: LoRAStacks
    segments: list[tuple[int, int, int]]  # (first row, end row, slot); base rows in none
    row_slots: torch.Tensor | None = None

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> None:
        """out[rows] += each segment's delta of `projection` (in place)."""
        is_summed = self.stacks.tp is not None and projection in _ROW_PARALLEL
        delta = torch.zeros_like(out) if is_summed else out
        if self.row_slots is None:
            self._add_by_segment(delta, x, layer, projection)
        else:
            self._add_by_kernel(delta, x, layer, projection)
        if is_summed:
            assert self.stacks.tp is not None
            out += self.stacks.tp.all_reduce(delta)

    def _add_by_kernel(
        self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str
    ) -> None:
        from asyncengine.kernels import lora_expand, lora_shrink

        stacks, row_slots = self.stacks, self.row_slots
        assert row_slots is not None
        x = x if x.stride(-1) == 1 else x.contiguous()
        for target in stacks.targets[projection]:
            key = (layer, target.module)
            shrunk = lora_shrink(x, stacks.a[key], row_slots)
            columns = out[:, target.offset : target.offset + target.num_out]
            lora_expand(columns, shrunk, stacks.b[key], stacks.scalings[key], row_slots)

    def _add_by_segment(
        self, delta: torch.Tensor, x: torch.Tensor, layer: int, projection: str
    ) -> None:
        stacks = self.stacks
        for start, end, slot in self.segments:
            modules = stacks.slot_modules[slot]
            rows = x[start:end]
            for target in stacks.targets[projection]:
                key = (layer, target.module)
                if key not in modules:
                    continue
                rank, scaling = modules[key]
                shrunk = rows @ stacks.a[key][slot, :rank].T
                delta[start:end, target.offset : target.offset + target.num_out].addmm_(
                    shrunk, stacks.b[key][slot, :, :rank].T, alpha=scaling
                )


def has_lora() -> bool:
    """Whether this forward adds LoRA deltas to some rows (`add_lora` then changes outputs)."""
    lora = current_lora()
    return lora is not None and bool(lora.segments)


def add_lora(out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> torch.Tensor:
    """`out` (the base projection of `x`) with the forward's LoRA deltas added, if any."""
    lora = current_lora()
    if lora is not None and lora.segments:
        lora.add(out, x, layer, projection)
    return out


def lora_segments(row_slots: list[int]) -> list[tuple[int, int, int]]:
    """Runs of equal slots in `row_slots` (-1: the base model, left out)."""
    segments: list[tuple[int, int, int]] = []
    start = 0
    for row in range(1, len(row_slots) + 1):
        if row == len(row_slots) or row_slots[row] != row_slots[start]:
            if row_slots[start] >= 0:
                segments.append((start, row, row_slots[start]))
            start = row
    return segments
