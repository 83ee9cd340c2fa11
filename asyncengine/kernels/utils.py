"""Checks and launch choices shared by the kernel wrappers."""

from __future__ import annotations

import functools
import os

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def is_interpreter() -> bool:
    """True when Triton runs kernels with its CPU interpreter (read by triton at `@jit` time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    # float32 caches are asked for accuracy: no TF32 rounding on the tensor cores
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels must upcast dot operands: the interpreter's dot is wrong for bfloat16."""
    return dtype == torch.bfloat16 and is_interpreter()


@functools.cache
def num_compute_units(device: torch.device) -> int:
    """SMs of a CUDA device; 1 elsewhere: the interpreter runs programs one after another, so
    more programs (KV splits) only add work there."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 1


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_kv_cache(kv_cache: torch.Tensor, name: str = "kv_cache") -> None:
    """[2, num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous, a known dtype."""
    require(
        kv_cache.dim() == 5 and kv_cache.shape[0] == 2,
        f"{name} must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
        f"got {tuple(kv_cache.shape)}",
    )
    require(kv_cache.dtype in SUPPORTED_DTYPES, f"{name} dtype {kv_cache.dtype} is not supported")
    require(kv_cache.stride(-1) == 1, f"{name} must be contiguous along head_dim")
    require(kv_cache.shape[-1] <= MAX_HEAD_DIM, f"{name} head_dim must be <= {MAX_HEAD_DIM}")


def check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    require(len(devices) == 1, f"tensors must be on one device, got {sorted(map(str, devices))}")


def check_attention_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """The checks shared by the attention wrappers; returns `out`, allocated when None.

    query [rows, num_heads, head_dim] with contiguous rows, num_heads a multiple of the cache's
    num_kv_heads; block_tables [num_seqs, max_num_blocks] int32; seq_lens [num_seqs] int32.
    """
    check_kv_cache(kv_cache)
    check_same_device(query, kv_cache, block_tables, seq_lens)
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    require(
        query.dim() == 3 and query.shape[2] == head_dim and query.stride(-1) == 1,
        f"query must be [rows, num_heads, {head_dim}] with contiguous rows, "
        f"got {tuple(query.shape)}",
    )
    require(
        query.shape[1] % num_kv_heads == 0,
        f"num_heads ({query.shape[1]}) must be a multiple of num_kv_heads ({num_kv_heads})",
    )
    require(query.dtype == kv_cache.dtype, f"query dtype {query.dtype} != cache {kv_cache.dtype}")
    num_seqs = seq_lens.shape[0]
    require(
        seq_lens.dim() == 1 and seq_lens.dtype == torch.int32, "seq_lens must be [num_seqs] int32"
    )
    require(
        block_tables.dim() == 2
        and block_tables.shape[0] == num_seqs
        and block_tables.dtype == torch.int32
        and block_tables.stride(1) == 1,
        f"block_tables must be [{num_seqs}, max_num_blocks] int32, row-contiguous",
    )
    require(sliding_window is None or sliding_window > 0, "sliding_window must be > 0 or None")
    if out is None:
        return torch.empty_like(query)
    require(
        out.shape == query.shape and out.dtype == query.dtype and out.stride(-1) == 1,
        "out must match query's shape and dtype, with contiguous rows",
    )
    return out
