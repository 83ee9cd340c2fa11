"""Triton kernels for the paged KV cache (filled in by the kernels issue)."""
