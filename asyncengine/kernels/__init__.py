"""Triton kernels for the paged KV cache and LoRA's batched products, each with a plain-torch
reference beside it.

Importing this package imports nothing yet: each name loads its module, and with it triton, on
first use. So `import asyncengine` never needs triton (a CPU install has none).

Set TRITON_INTERPRET=1 before the first use to run the kernels on CPU tensors with Triton's
interpreter (what the tests do). The kernel tests pass under the interpreters of triton 3.9
and 3.6; triton 3.6's needs numpy < 2.3 (with numpy 2.4 its loop bounds fail to convert to
ints), which only matters to the interpreter, never to a GPU run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .block_copy import (
        copy_blocks,
        copy_blocks_ref,
        swap_blocks_ref,
        swap_in_blocks,
        swap_out_blocks,
    )
    from .decode_attention import (
        choose_num_splits,
        paged_decode_attention,
        paged_decode_attention_ref,
    )
    from .lora import lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref
    from .prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
    from .store_kv import store_kv, store_kv_ref

_MODULE_OF = {
    "copy_blocks": "block_copy",
    "copy_blocks_ref": "block_copy",
    "swap_blocks_ref": "block_copy",
    "swap_in_blocks": "block_copy",
    "swap_out_blocks": "block_copy",
    "choose_num_splits": "decode_attention",
    "paged_decode_attention": "decode_attention",
    "paged_decode_attention_ref": "decode_attention",
    "lora_expand": "lora",
    "lora_expand_ref": "lora",
    "lora_shrink": "lora",
    "lora_shrink_ref": "lora",
    "paged_prefill_attention": "prefill_attention",
    "paged_prefill_attention_ref": "prefill_attention",
    "store_kv": "store_kv",
    "store_kv_ref": "store_kv",
}

__all__ = [
    "choose_num_splits",
    "copy_blocks",
    "copy_blocks_ref",
    "lora_expand",
    "lora_expand_ref",
    "lora_shrink",
    "lora_shrink_ref",
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


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # bind every name at once: importing the submodule `store_kv` sets this package's
    # attribute `store_kv` to that module, which the function must replace afterwards
    for attr, module_name in _MODULE_OF.items():
        globals()[attr] = getattr(importlib.import_module(f".{module_name}", __name__), attr)
    return globals()[name]
