"""C++ ops for the CPU path, compiled on first use and cached: paged decode and prefill
attention, the decoder's pointwise layers in one pass each (RMSNorm, alone or with the residual
add before it; rotary embedding; SiLU-and-multiply), and a bfloat16 linear layer for CPUs with
AVX512-BF16, which can end a gate/up product in SiLU-and-multiply.

The sources (csrc/) are built once per machine, torch version and source with the host's C++
compiler for the host's CPU (-march=native), into a cache directory; later starts only load
the library. Without a compiler, or with ASYNCENGINE_CPU_OPS=0, `load()` returns False and every
caller keeps its plain-torch code. A build is announced in the log before it starts
(`cpu_ops_compiling`, with its expected seconds: a minute or more on a busy 2-core machine) and
after it ends (`cpu_ops_compiled`, with the seconds it took).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from asyncengine.logging import get_logger

logger = get_logger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    CSRC / "paged_attention.cpp",
    CSRC / "prefill_attention.cpp",
    CSRC / "pointwise.cpp",
    CSRC / "bf16_linear.cpp",
)
BF16_LINEAR_COLUMNS = 32  # outputs per column tile of `pack_bf16_weight`
HEADERS = (CSRC / "cpu_common.h",)
# reassociation lets the compiler vectorize the dot products' sums; no finite-math-only, since
# the softmax starts from -inf
CFLAGS = (
    "-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
    "-fassociative-math", "-fno-signed-zeros", "-std=c++17",
)  # fmt: skip

# measured: ~10 s of one core per source on a 2-core VM, most of it parsing torch's headers
CPU_S_PER_SOURCE = 10.0

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet in this process


def load() -> bool:
    """Build (first use on this machine: seconds) or load the ops; False where they cannot be."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def is_loaded() -> bool:
    """Whether `load()` has run and succeeded (never builds)."""
    return bool(_loaded)


def _load() -> bool:
    if os.environ.get("ASYNCENGINE_CPU_OPS", "1") == "0":
        logger.info("cpu_ops_disabled", reason="ASYNCENGINE_CPU_OPS=0", decode="plain torch")
        return False
    start = time.perf_counter()
    try:
        library, was_built = _build()
        torch.ops.load_library(str(library))
    except Exception as exc:  # no compiler, headers or write access: the torch path still runs
        logger.warning(
            "cpu_ops_unavailable",
            reason=f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
            decode="plain torch",
        )
        return False
    logger.info(
        "cpu_ops_ready",
        library=str(library),
        was_built=was_built,
        seconds=round(time.perf_counter() - start, 2),
    )
    return True


def _build() -> tuple[Path, bool]:
    """The compiled library in the cache (built now if absent) and whether it was built now."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or $CXX) on PATH")
    # -march=native code must never run on another CPU, so the CPU's flags are in the key
    key = hashlib.sha256(
        b"\0".join(
            [
                *(path.read_bytes() for path in (*SOURCES, *HEADERS)),
                " ".join(CFLAGS).encode(),
                torch.__version__.encode(),
                compiler.encode(),
                _cpu_flags().encode(),
            ]
        )
    ).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asyncengine"
    library = cache / f"cpu_ops-{key}.so"
    if library.exists():
        return library, False
    # a first start's pause of a minute or more, said before it happens
    logger.info(
        "cpu_ops_compiling",
        note="once per machine and version: later starts load the cached build",
        expected_s=_expected_compile_s(),
        library=str(library),
    )
    start = time.perf_counter()
    _compile(compiler, library)
    logger.info("cpu_ops_compiled", seconds=round(time.perf_counter() - start, 1))
    return library, True


def _expected_compile_s() -> int:
    """The build's likely wall time here: its sources compile at once, each ~CPU_S_PER_SOURCE
    of a core, and share the cores with whatever else runs (the load average)."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    demand = (load + len(SOURCES)) / (os.cpu_count() or 1)
    return round(CPU_S_PER_SOURCE * max(1.0, demand))


def _compile(compiler: str, library: Path) -> None:
    """Compile SOURCES and link them into `library` (its directory is the cache)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    cache = library.parent
    cache.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{p}" for p in include_paths()]
    libs = [*(f"-L{p}" for p in library_paths()), *(f"-Wl,-rpath,{p}" for p in library_paths())]
    # built beside its final name, then renamed: a concurrent build never sees half a file
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        compiles = [  # one process per source, at once: most of the time is torch's headers
            subprocess.Popen(
                [compiler, *CFLAGS, "-fPIC", "-c", str(source), *includes, "-o", str(obj)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for source, obj in zip(SOURCES, objects)
        ]
        errors = [job.communicate()[1] for job in compiles]
        partial = Path(tmp) / library.name
        if all(job.returncode == 0 for job in compiles):
            link = [
                compiler,
                "-shared",
                "-fopenmp",
                *map(str, objects),
                *libs,
                "-lc10",
                "-ltorch_cpu",
            ]
            result = subprocess.run([*link, "-o", str(partial)], capture_output=True, text=True)
            errors.append(result.stderr if result.returncode else "")
        if not partial.exists():
            raise RuntimeError(f"{compiler} failed: {''.join(errors).strip()[-2000:]}")
        os.replace(partial, library)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return sys.platform


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence over its paged K/V ([num_seqs, heads, dim] -> same).

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; block_tables: [num_seqs,
    max_blocks] int32; seq_lens: [num_seqs] int32, each counting the new token. With a window,
    a sequence sees its last `sliding_window` tokens. Needs `load()` to have succeeded.
    """
    _check_paged_inputs(query, kv_cache, block_tables=block_tables, seq_lens=seq_lens)
    query = query.contiguous()
    out = torch.empty_like(query) if out is None else out
    torch.ops.asyncengine.paged_decode_attention(
        out, query, kv_cache, block_tables, seq_lens, scale, sliding_window or 0
    )
    return out


def paged_decode_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain-torch `paged_decode_attention`: the prefill reference with one new token a
    sequence."""
    one_each = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    return paged_prefill_attention_ref(
        query, kv_cache, block_tables, one_each, seq_lens, scale, sliding_window
    )


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sequence's new tokens over its paged K/V, causal ([tokens, heads, dim] -> same).

    Sequence i's new tokens are rows `query_start_loc[i]:query_start_loc[i + 1]` of `query`
    (int32, from 0 to its length), the last of its `seq_lens[i]` positions, their K/V already
    in the cache; each attends to the positions up to its own (its last `sliding_window` with
    a window). block_tables: [num_seqs, max_blocks] int32. Needs `load()` to have succeeded.
    """
    _check_paged_inputs(
        query, kv_cache,
        block_tables=block_tables, query_start_loc=query_start_loc, seq_lens=seq_lens,
    )  # fmt: skip
    query = query.contiguous()
    out = torch.empty_like(query) if out is None else out
    torch.ops.asyncengine.paged_prefill_attention(
        out, query, kv_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window or 0
    )
    return out


def _check_paged_inputs(
    query: torch.Tensor, kv_cache: torch.Tensor, **int32_tensors: torch.Tensor
) -> None:
    """What both attention ops need of their inputs, each fault named (the ops check shapes)."""
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError("query must be [rows, heads, dim], kv_cache [2, blocks, bs, kvh, dim]")
    if query.shape[1] % kv_cache.shape[3] or query.shape[2] != kv_cache.shape[4]:
        raise ValueError("num_heads must be a multiple of num_kv_heads, head_dims must match")
    if query.dtype != kv_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from the cache's {kv_cache.dtype}")
    not_int32 = [name for name, tensor in int32_tensors.items() if tensor.dtype != torch.int32]
    if not_int32:
        raise ValueError(f"{' and '.join(not_int32)} must be int32")


def paged_prefill_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain-torch `paged_prefill_attention`: float32, one sequence, head and row at a time."""
    out = torch.empty_like(query)
    group = query.shape[1] // kv_cache.shape[3]
    block_size = kv_cache.shape[2]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, : -(-seq_len // block_size)].long()
        key, value = kv_cache[:, blocks].flatten(1, 2)[:, :seq_len].float()
        context_len = seq_len - (starts[i + 1] - starts[i])
        for row in range(starts[i], starts[i + 1]):
            pos = context_len + row - starts[i]
            first = 0 if sliding_window is None else max(0, pos + 1 - sliding_window)
            k, v = key[first : pos + 1], value[first : pos + 1]  # [seen, kv_heads, dim]
            for head in range(query.shape[1]):
                weights = torch.softmax(k[:, head // group] @ query[row, head].float() * scale, 0)
                out[row, head] = (weights @ v[:, head // group]).to(query.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x * rsqrt(mean(x^2) + eps))` over the last dim of a contiguous [rows, dim]
    `x`, in float32, rounded where transformers' LlamaRMSNorm rounds."""
    out = torch.empty_like(x)
    torch.ops.asyncengine.rms_norm(out, x, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x` (in place, rounded to the dtype), then `rms_norm` of it: (the norm,
    `residual`). Both contiguous [rows, dim] of one dtype."""
    out = torch.empty_like(x)
    torch.ops.asyncengine.add_rms_norm(out, residual, x, weight, eps)
    return out, residual


def rotary_embedding_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate [tokens, heads, head_dim] `x` in place (rotate-half layout); returns it.

    cos, sin: float32 [max_positions, head_dim / 2]; `x` may be a view with strided rows.
    """
    torch.ops.asyncengine.rotary_embedding(x, positions, cos, sin)
    return x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a contiguous [rows, 2n] `x` holding gate then up: [rows, n]."""
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    torch.ops.asyncengine.silu_and_mul(out, x)
    return out


def bf16_linear_available() -> bool:
    """Whether `bf16_linear` runs here: the ops load and were built for AVX512-BF16."""
    return load() and bool(torch.ops.asyncengine.bf16_linear_available())


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 [N, K] weight in `bf16_linear`'s layout, [N / 32, K / 2, 32, 2]: per tile of
    32 outputs, their weights two input columns at a time. N must divide by 32, K by 2."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or n % BF16_LINEAR_COLUMNS or k % 2:
        raise ValueError(f"needs a bfloat16 [32 * i, 2 * j] weight, got {weight.dtype} {n}x{k}")
    tiles = weight.reshape(n // BF16_LINEAR_COLUMNS, BF16_LINEAR_COLUMNS, k // 2, 2)
    return tiles.permute(0, 2, 1, 3).contiguous()


def pair_gate_up(stacked: torch.Tensor) -> torch.Tensor:
    """A gate's rows stacked over an up projection's ([N, ...] or [N], gate first), reordered
    for `bf16_linear_silu_mul`: each tile of 32 holds 16 gate rows, then the same 16 up rows.
    N must divide by 32."""
    half = BF16_LINEAR_COLUMNS // 2
    pairs = stacked.reshape(2, stacked.shape[0] // BF16_LINEAR_COLUMNS, half, *stacked.shape[1:])
    return pairs.transpose(0, 1).reshape(stacked.shape)


def unpair_gate_up(out: torch.Tensor) -> torch.Tensor:
    """The columns of a product over a `pair_gate_up` weight put back: gate's, then up's."""
    half = BF16_LINEAR_COLUMNS // 2
    rows, n = out.shape
    return out.view(rows, n // BF16_LINEAR_COLUMNS, 2, half).transpose(1, 2).reshape(rows, n)


def bf16_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear` of a contiguous bfloat16 [rows, K] `x` over a `pack_bf16_weight` weight:
    [rows, N], float32 products and sums rounded once. Needs `bf16_linear_available()`."""
    out = x.new_empty((x.shape[0], packed.shape[0] * BF16_LINEAR_COLUMNS))
    torch.ops.asyncengine.bf16_linear(out, x, packed, bias)
    return out


def bf16_linear_silu_mul(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`silu_and_mul` of `bf16_linear`, in one pass: `packed` is a gate over an up projection
    paired by `pair_gate_up` (and `bias` so paired), the result [rows, N / 2], rounded as the
    two ops round."""
    out = x.new_empty((x.shape[0], packed.shape[0] * BF16_LINEAR_COLUMNS // 2))
    torch.ops.asyncengine.bf16_linear_silu_mul(out, x, packed, bias)
    return out
