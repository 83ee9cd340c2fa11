"""Random paged-KV inputs shared by the kernel tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

TOLERANCE = {  # (atol, rtol) against a float32 reference computed from the same inputs
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@dataclass
class PagedKV:
    """A random paged cache holding `seq_lens` tokens per sequence; every other slot is NaN."""

    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32


def make_paged_kv(
    seq_lens: Sequence[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_spare_blocks: int = 3,
    share_prefix: bool = True,
) -> PagedKV:
    """Random non-contiguous block tables; sequences of more than one block share their first
    block (a common prefix); unused slots and blocks hold NaN so a read past
    a sequence's end shows in the output. Table padding points at real (NaN) blocks."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + num_spare_blocks
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(n)] for n in needed]
    donor = max(range(len(tables)), key=lambda i: len(tables[i]))
    for table in tables:
        if share_prefix and len(tables[donor]) > 1 and len(table) > 1:
            table[0] = tables[donor][0]  # tokens 0..block_size-1 shared, full in both
    width = max(needed)
    padded = [t + torch.randint(0, num_blocks, (width - len(t),)).tolist() for t in tables]
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    for table, n in zip(tables, seq_lens):
        for i, block in enumerate(table):
            used = min(block_size, n - i * block_size)
            if bool(kv_cache[0, block, 0, 0, 0].isnan()):  # a shared block is filled once
                kv_cache[:, block, :used] = torch.randn(2, used, num_kv_heads, head_dim)
    return PagedKV(
        kv_cache.to(dtype),
        torch.tensor(padded, dtype=torch.int32),
        torch.tensor(list(seq_lens), dtype=torch.int32),
    )


def random_seq_lens(num_seqs: int, block_size: int, max_len: int) -> list[int]:
    """Lengths in [1, max_len]: one of 1, one not a multiple of block_size past one block."""
    lens = torch.randint(1, max_len + 1, (num_seqs,)).tolist()
    lens[0] = 1
    if num_seqs > 1 and max_len > block_size + 1:
        lens[1] = int(torch.randint(block_size + 1, max_len + 1, ()))
        if lens[1] % block_size == 0:
            lens[1] -= 1
    return lens
