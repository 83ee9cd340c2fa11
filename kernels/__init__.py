"""Triton kernels for the paged KV cache, each with a plain-torch reference beside it.

Importing this package imports triton. Set TRITON_INTERPRET=1 before that to run the kernels
on CPU tensors with Triton's interpreter (what the tests do). The kernel tests pass under the
interpreters of triton 3.9 and 3.6; triton 3.6's needs numpy < 2.3 (with numpy 2.4 its loop
bounds fail to convert to ints), which only matters to the interpreter, never to a GPU run.
"""

from .block_copy import (
    copy_blocks,
    copy_blocks_ref,
    swap_blocks_ref,
    swap_in_blocks,
    swap_out_blocks,
)
from .decode_attention import choose_num_splits, paged_decode_attention, paged_decode_attention_ref
from .prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from .store_kv import store_kv, store_kv_ref

__all__ = [
    "choose_num_splits",
    "copy_blocks",
    "copy_blocks_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "store_kv",
    "store_kv_ref",
    "swap_blocks_ref",
    "swap_in_blocks",
    "swap_out_blocks",
]
