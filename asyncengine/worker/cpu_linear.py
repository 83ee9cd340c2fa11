"""Linear layers on the CPU with their weights prepacked for oneDNN, once, at load.

`nn.Linear` hands oneDNN a plain [out, in] weight, which it reorders into its blocked layout on
every call: at decode's few rows that copy costs about as much as the product (1.2x at 48 rows
in bf16, 1.5x at 16; 2-3x in fp32, where torch otherwise calls MKL). torch.compile's CPU
freezing packs weights the same way, with the same two ops.

The packed op builds and keeps a oneDNN primitive (~250 KB of descriptors and JIT code) for
every row count it is called with, and a step's row count is its number of scheduled tokens:
anything up to max_num_batched_tokens. Called as it came, a server's memory grew by ~70 MB per
300 mixed requests, without end. Rows are therefore padded up to one of a fixed set of counts
(`padded_rows`: exact to 16, then 8 steps per doubling, at most 1/8 extra), which bounds the
primitives to ~70 per weight shape.

In float32 a small weight (under 1M elements) keeps its plain copy as well: for a product of at
most 8 rows (decode at small batches, a verification of drafts) MKL's sgemm on it beats the
packed op's fixed cost by 1.3-3x (256 x 704 at one row: 15 against 40 us), while the packed op
wins from ~16 rows (512 x 512 at 16 rows: 52 against 111 us). Larger float32 weights are about
even at one row, and bfloat16 is faster packed at every row count.

Where the CPU has AVX512-BF16 but not AMX, a bfloat16 weight goes instead into the layout of
the C++ `bf16_linear` op (cpu_ops.py; any row count, no primitives kept): a model's weights come
from memory on every step, and that op keeps the memory stream and the arithmetic busy together:
over a forward's weights read from memory, 1.5x the oneDNN product at 16 rows, 1.2x at 1 and
at 64, no slower at 512 (benchmarks/cpu_kernels.py). With AMX, oneDNN's tiles multiply far faster
than AVX-512 can, and its layout stays.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from asyncengine.config import cpu_bf16_flag
from asyncengine.logging import get_logger
from asyncengine.worker import cpu_ops

logger = get_logger(__name__)

_PACKED_DTYPES = (torch.float32, torch.bfloat16)
_BATCH_HINT = 64  # oneDNN picks its layout for about this many rows; any count works
_MAX_PLAIN_NUMEL = 1 << 20  # float32 weights under this size keep a plain copy too
_MAX_PLAIN_ROWS = 8  # ... used by products of at most this many rows


# A linear of one of these names holds a gate's outputs, then an up projection's (the fused MLP
# input of the Llama family): in `bf16_linear`'s tiles it is packed in pairs, so that its
# product can end in silu(gate) * up (`PackedLinear.silu_and_mul`)
GATED_LINEAR_NAMES = frozenset({"gate_up_proj"})


class PackedLinear(nn.Module):
    """`nn.Linear` over a weight packed once: in `bf16_linear`'s column tiles where that op
    runs and fits the shape, else in oneDNN's blocked layout (opaque: read only by the op).

    `gated`: the linear stacks a gate over an up projection; in column tiles they are paired
    (`cpu_ops.pair_gate_up`) and `is_gated` is set: `silu_and_mul` then takes the activation in
    the product's own pass, and `forward` still gives the columns in the linear's order.
    """

    def __init__(self, linear: nn.Linear, gated: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight: torch.Tensor
        weight = linear.weight.detach()
        self.bias = linear.bias
        self.bf16_tiles = _fits_bf16_linear(weight, self.bias)
        self.is_gated = gated and self.bf16_tiles
        if self.is_gated:
            weight = cpu_ops.pair_gate_up(weight)
            if self.bias is not None:
                paired_bias = cpu_ops.pair_gate_up(self.bias.detach())
                self.bias = nn.Parameter(paired_bias, requires_grad=False)
        if self.bf16_tiles:
            self.register_buffer("packed_weight", cpu_ops.pack_bf16_weight(weight))
        else:
            self.register_buffer(
                "packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
            )
        self.plain_weight: torch.Tensor | None = None
        if weight.dtype == torch.float32 and weight.numel() < _MAX_PLAIN_NUMEL:
            self.plain_weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.bf16_tiles:
            flat = x.reshape(rows, self.in_features).contiguous()
            out = cpu_ops.bf16_linear(flat, self.packed_weight, self.bias)
            if self.is_gated:
                out = cpu_ops.unpair_gate_up(out)
            return out.view(*x.shape[:-1], self.out_features)
        if self.plain_weight is not None and rows <= _MAX_PLAIN_ROWS:
            return nn.functional.linear(x, self.plain_weight, self.bias)
        padded = padded_rows(rows)
        flat = x.reshape(rows, self.in_features)
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])
        out = torch.ops.mkldnn._linear_pointwise(
            flat, self.packed_weight, self.bias, "none", [], ""
        )
        return out[:rows].view(*x.shape[:-1], self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of this product, in its own pass: [..., out_features / 2]. Only
        where `is_gated`."""
        assert self.is_gated, "silu_and_mul needs a gate and up projection in column tiles"
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features).contiguous()
        out = cpu_ops.bf16_linear_silu_mul(flat, self.packed_weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features // 2)


def _fits_bf16_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    n, k = weight.shape
    return (
        weight.dtype == torch.bfloat16
        and (bias is None or bias.dtype == torch.bfloat16)
        and n % cpu_ops.BF16_LINEAR_COLUMNS == 0
        and k % 2 == 0
        and _bf16_linear_is_fastest()
    )


@functools.cache
def _bf16_linear_is_fastest() -> bool:
    return cpu_bf16_flag() == "avx512_bf16" and cpu_ops.bf16_linear_available()


def padded_rows(rows: int) -> int:
    """The row count a packed product runs with: `rows` up to 16, then the next of 8 evenly
    spaced counts per doubling (18, 20, ..., 32, 36, ..., 64, 72, ...)."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)  # 1/8 of the power of two below `rows`
    return -(-rows // step) * step


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every `nn.Linear` of a CPU model by a `PackedLinear`; returns how many.

    A weight another module shares (a tied LM head) stays as it is: packing would hold it
    twice. Nothing is packed where oneDNN is missing, lacks the dtype, or gives a different
    product on a probe (the ops are torch internals: a change in them falls back, never breaks).
    """
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    if not linears or not _can_pack(linears[0][1]):
        return 0
    shared = {
        id(p)
        for m in model.modules()
        if not isinstance(m, nn.Linear)
        for p in m.parameters(recurse=False)
    }
    num_packed = num_in_tiles = 0
    for name, linear in linears:
        if id(linear.weight) in shared:
            continue
        parent_name, _, attr = name.rpartition(".")
        packed = PackedLinear(linear, gated=attr in GATED_LINEAR_NAMES)
        setattr(model.get_submodule(parent_name), attr, packed)
        num_packed += 1
        num_in_tiles += packed.bf16_tiles
    logger.info(
        "linear_weights_packed",
        num_layers=num_packed,
        bf16_linear_op=num_in_tiles,  # the rest in oneDNN's layout
        dtype=str(linears[0][1].weight.dtype),
    )
    return num_packed


def _can_pack(linear: nn.Linear) -> bool:
    weight = linear.weight
    if (
        not weight.is_cpu
        or weight.dtype not in _PACKED_DTYPES
        or not torch.backends.mkldnn.is_available()
    ):
        return False
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        probe = torch.randn(3, linear.in_features, dtype=weight.dtype)
        with torch.inference_mode():
            expected = nn.functional.linear(probe, weight, linear.bias)
            got = PackedLinear(linear)(probe)
        tol = 1e-2 if weight.dtype == torch.bfloat16 else 1e-4
        ok = bool(torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol))
    except Exception as exc:  # an op missing or changed in this torch
        logger.warning("linear_packing_unavailable", reason=f"{type(exc).__name__}: {exc}"[:300])
        return False
    if not ok:
        logger.warning("linear_packing_unavailable", reason="the packed product differs")
    return ok
