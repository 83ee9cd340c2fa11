"""lora_shrink / lora_expand: batched LoRA products, each row with its own adapter (BGMV).

Punica's split: `shrink` takes each row's input to its adapter's rank (y = x @ A[slot].T),
`expand` adds the scaled product back (out += scaling[slot] * y @ B[slot].T). The adapters sit
in stacks of slots ([slots, rank, in] and [slots, out, rank]); each row names its slot, -1 for
the base model (left as it is). A program handles one row, so rows of any adapters mix freely.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import check_same_device, next_power_of_2, require


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [num_rows, num_in], last dim contiguous
    a_ptr,  # [num_slots, rank, num_in], contiguous
    slots_ptr,  # [num_rows] int32/int64: the row's adapter slot, -1 = none
    y_ptr,  # [num_rows, rank] float32, zero on entry
    num_in,
    stride_x_row,
    stride_a_slot,
    stride_a_rank,
    stride_y_row,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, num_in, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            in_k = offs_k < num_in
            x = tl.load(x_ptr + row * stride_x_row + offs_k, mask=in_k, other=0.0)
            a = tl.load(
                a_ptr + slot * stride_a_slot + offs_r[:, None] * stride_a_rank + offs_k[None, :],
                mask=(offs_r < RANK)[:, None] & in_k[None, :],
                other=0.0,
            )
            acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(y_ptr + row * stride_y_row + offs_r, acc, mask=offs_r < RANK)


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [num_rows, rank] float32
    b_ptr,  # [num_slots, num_out, rank], contiguous
    scalings_ptr,  # [num_slots] float32
    slots_ptr,  # [num_rows] int32/int64, -1 = none
    out_ptr,  # [num_rows, num_out], last dim contiguous (a column slice of a wider output)
    num_out,
    stride_y_row,
    stride_b_slot,
    stride_b_out,
    stride_o_row,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        in_n = offs_n < num_out
        y = tl.load(y_ptr + row * stride_y_row + offs_r, mask=offs_r < RANK, other=0.0)
        b = tl.load(
            b_ptr + slot * stride_b_slot + offs_n[:, None] * stride_b_out + offs_r[None, :],
            mask=in_n[:, None] & (offs_r < RANK)[None, :],
            other=0.0,
        )
        delta = tl.sum(b.to(tl.float32) * y[None, :], axis=1) * tl.load(scalings_ptr + slot)
        out_ptrs = out_ptr + row * stride_o_row + offs_n
        out = tl.load(out_ptrs, mask=in_n, other=0.0)
        tl.store(out_ptrs, (out.to(tl.float32) + delta).to(out.dtype), mask=in_n)


def _check_slots(slots: torch.Tensor, num_rows: int) -> None:
    require(
        slots.shape == (num_rows,) and slots.dtype in (torch.int32, torch.int64),
        f"slots must be [{num_rows}] int32/int64, got {tuple(slots.shape)} {slots.dtype}",
    )


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y[row] = x[row] @ a_stack[slots[row]].T in float32 ([num_rows, rank]); 0 where the
    slot is -1."""
    check_same_device(x, a_stack, slots)
    require(x.dim() == 2 and x.stride(-1) == 1, "x must be [num_rows, num_in], rows contiguous")
    require(
        a_stack.dim() == 3 and a_stack.shape[2] == x.shape[1] and a_stack.is_contiguous(),
        f"a_stack must be a contiguous [slots, rank, {x.shape[1]}], got {tuple(a_stack.shape)}",
    )
    require(x.dtype == a_stack.dtype, f"x ({x.dtype}) and a_stack ({a_stack.dtype}) differ")
    num_rows, num_in = x.shape
    _check_slots(slots, num_rows)
    rank = a_stack.shape[1]
    y = torch.zeros((num_rows, rank), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return y
    block_r = next_power_of_2(rank)
    block_k = max(16, min(next_power_of_2(num_in), 8192 // block_r))
    _lora_shrink_kernel[(num_rows,)](
        x, a_stack, slots, y, num_in, x.stride(0), a_stack.stride(0), a_stack.stride(1),
        y.stride(0), RANK=rank, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return y


def lora_expand(
    out: torch.Tensor,
    y: torch.Tensor,
    b_stack: torch.Tensor,
    scalings: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """out[row] += scalings[slot] * y[row] @ b_stack[slot].T, slot = slots[row], in place;
    rows whose slot is -1 are left as they are. `out` may be a column slice."""
    check_same_device(out, y, b_stack, scalings, slots)
    require(out.dim() == 2 and out.stride(-1) == 1, "out must be [num_rows, num_out]")
    num_rows, num_out = out.shape
    require(
        b_stack.dim() == 3 and b_stack.shape[1] == num_out and b_stack.is_contiguous(),
        f"b_stack must be a contiguous [slots, {num_out}, rank], got {tuple(b_stack.shape)}",
    )
    rank = b_stack.shape[2]
    require(
        y.shape == (num_rows, rank) and y.dtype == torch.float32 and y.stride(-1) == 1,
        f"y must be [{num_rows}, {rank}] float32, got {tuple(y.shape)} {y.dtype}",
    )
    require(
        scalings.shape == (b_stack.shape[0],) and scalings.dtype == torch.float32,
        f"scalings must be [{b_stack.shape[0]}] float32",
    )
    _check_slots(slots, num_rows)
    if num_rows == 0:
        return
    block_r = next_power_of_2(rank)
    block_n = max(16, min(next_power_of_2(num_out), 8192 // block_r))
    grid = (num_rows, triton.cdiv(num_out, block_n))
    _lora_expand_kernel[grid](
        y, b_stack, scalings, slots, out, num_out, y.stride(0), b_stack.stride(0),
        b_stack.stride(1), out.stride(0), RANK=rank, BLOCK_R=block_r, BLOCK_N=block_n,
        num_warps=4,
    )  # fmt: skip


def lora_shrink_ref(x: torch.Tensor, a_stack: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Plain-torch `lora_shrink`."""
    y = torch.zeros((x.shape[0], a_stack.shape[1]), dtype=torch.float32, device=x.device)
    keep = slots >= 0
    a = a_stack[slots[keep].long()].float()
    y[keep] = torch.einsum("rk,rnk->rn", x[keep].float(), a)
    return y


def lora_expand_ref(
    out: torch.Tensor,
    y: torch.Tensor,
    b_stack: torch.Tensor,
    scalings: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Plain-torch `lora_expand`."""
    keep = slots >= 0
    chosen = slots[keep].long()
    delta = torch.einsum("rk,rnk->rn", y[keep], b_stack[chosen].float())
    out[keep] = (out[keep].float() + delta * scalings[chosen][:, None]).to(out.dtype)
