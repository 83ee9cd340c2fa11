"""What every benchmark prints about the CPU it ran on: the flags that decide its matmul speed.

bfloat16 is native with avx512_bf16 or amx_bf16 and emulated without (several times slower), so
figures from different machines compare only with these beside them.
"""

from __future__ import annotations

from pathlib import Path

MATMUL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_flags() -> str:
    """The CPU's MATMUL_FLAGS it has, space-separated; "-" for none (or no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "-"
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    return " ".join(f for f in MATMUL_FLAGS if f in flags) or "-"
