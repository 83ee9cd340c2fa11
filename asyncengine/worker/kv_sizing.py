"""KV cache sizing: the memory breakdown, the number of blocks it leaves, and the start-up checks.

Pure arithmetic on numbers the model runner measures (CUDA) or reads (host memory), so every
rule here is testable without a GPU. Each check fails at start-up with the numbers, so nothing
runs out of memory later.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from asyncengine.config import EngineConfig, SchedulerConfig
from asyncengine.errors import KVCacheSizingError

GiB = 1 << 30

# host memory that pinned swap blocks must leave to the process and the OS
HOST_RESERVE_FRACTION = 0.1
# device memory below this fraction left outside the budget starves the runtime (allocator
# fragmentation, CUDA graphs, NCCL, other libraries) and turns into OOMs under load
MIN_RUNTIME_FRACTION = 0.1
# block sizes the attention kernels are tuned for: smaller ones multiply block-table reads,
# larger ones waste half a block per request on average and coarsen prefix-cache reuse
TUNED_BLOCK_SIZES = (16, 128)
# max_num_seqs as a multiple of the expected peak concurrency: recommended, and tolerated
RECOMMENDED_SEQS_PER_REQUEST = (1.2, 1.5)
TOLERATED_SEQS_PER_REQUEST = (1.0, 2.0)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Where the device's memory goes (bytes); the KV cache gets what the budget leaves.

    CUDA: weights, activation peak and non-torch memory (CUDA context, cuBLAS and NCCL
    workspaces) are measured around a profile forward. CPU: the device is host memory;
    `non_torch_bytes` is every other use of it (other processes included), the activation peak
    is an estimate, and the swap pool (also host memory) comes out of the same budget.
    """

    device: str
    total_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    swap_bytes: int
    bytes_per_block: int
    is_activation_measured: bool

    @property
    def budget_bytes(self) -> int:
        return int(self.total_bytes * self.gpu_memory_utilization)

    @property
    def kv_cache_bytes(self) -> int:
        used = self.weights_bytes + self.activation_peak_bytes + self.non_torch_bytes
        return self.budget_bytes - used - self.swap_bytes

    @property
    def num_blocks(self) -> int:
        return max(self.kv_cache_bytes // self.bytes_per_block, 0)

    def log_fields(self) -> dict[str, Any]:
        """The breakdown in GiB (rounded) for the one `kv_cache_sized` log line."""
        gib = lambda n: round(n / GiB, 3)  # noqa: E731
        return {
            "device": self.device,
            "total_gib": gib(self.total_bytes),
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "budget_gib": gib(self.budget_bytes),
            "weights_gib": gib(self.weights_bytes),
            "activation_peak_gib": gib(self.activation_peak_bytes),
            "activation_measured": self.is_activation_measured,
            "non_torch_gib": gib(self.non_torch_bytes),
            "swap_in_budget_gib": gib(self.swap_bytes),
            # what the budget leaves; the pools' own size (after any cap) is logged beside it
            "kv_budget_gib": gib(max(self.kv_cache_bytes, 0)),
            "bytes_per_block": self.bytes_per_block,
        }

    def describe(self) -> str:
        """One sentence with every number, for start-up errors."""
        f = self.log_fields()
        swap = f" - swap {f['swap_in_budget_gib']} GiB" if self.swap_bytes else ""
        return (
            f"{self.device} memory {f['total_gib']} GiB x gpu_memory_utilization "
            f"{self.gpu_memory_utilization} = {f['budget_gib']} GiB; minus weights "
            f"{f['weights_gib']} GiB - activation peak {f['activation_peak_gib']} GiB - "
            f"non-torch {f['non_torch_gib']} GiB{swap} leaves {round(self.kv_cache_bytes / GiB, 3)}"
            f" GiB for the KV cache ({self.bytes_per_block} bytes per block)"
        )


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    if "MemAvailable" in info:
        return info["MemAvailable"], info["MemTotal"]
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages // 2, pages


def estimate_activation_bytes(hf_config: Any, sched: SchedulerConfig, dtype_size: int) -> int:
    """A rough activation peak of the largest forward, where it cannot be measured (CPU).

    The widest activations (hidden, qkv, gate+up) of max_num_batched_tokens live at once, plus
    the float32 logits of every sequence and the float32 attention scores of one chunk over a
    full context.
    """
    tokens = sched.max_num_batched_tokens
    width = 4 * hf_config.hidden_size + 3 * hf_config.intermediate_size
    logits = sched.max_num_seqs * hf_config.vocab_size * 4
    scores = hf_config.num_attention_heads * min(tokens, sched.max_model_len) * sched.max_model_len
    return tokens * width * dtype_size + logits + scores * 4


def blocks_per_request(max_model_len: int, block_size: int, sliding_window: int | None) -> int:
    """Blocks one max_model_len request holds at its longest (a window releases older ones)."""
    num_tokens = max_model_len if sliding_window is None else min(max_model_len, sliding_window)
    # with a window, the block the window starts in and the one being written are both held
    extra = 0 if sliding_window is None or num_tokens == max_model_len else 1
    return math.ceil(num_tokens / block_size) + extra


def check_one_request_fits(
    sized_by: str,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    sliding_window: int | None = None,
) -> None:
    """Raise if the sized pool cannot hold a single max_model_len request.

    `sized_by` says where the pool's size came from (a breakdown's `describe()`, or the fixed
    size asked for), for the error.
    """
    needed = blocks_per_request(max_model_len, block_size, sliding_window)
    if num_blocks >= needed:
        return
    fits_len = num_blocks * block_size
    raise KVCacheSizingError(
        f"the KV cache cannot hold one max_model_len ({max_model_len}) request: {num_blocks} "
        f"blocks of {block_size} tokens hold {fits_len} tokens, {needed} blocks are needed. "
        f"{sized_by}. Raise gpu_memory_utilization (or kv_cache_memory_bytes), lower "
        f"max_model_len (to at most {fits_len}) or max_num_batched_tokens, lower swap_space on "
        f"a CPU device, or use a smaller model or dtype"
    )


def num_swap_blocks(
    swap_space_bytes: int,
    bytes_per_block: int,
    max_useful_blocks: int,
    host_available_bytes: int,
    host_total_bytes: int,
    is_pinned: bool,
) -> int:
    """CPU swap blocks for `swap_space`; raise (naming swap_space) if host memory lacks room.

    A pinned pool larger than the host can spare would be an out-of-memory kill at start-up
    or, worse, later; refusing with the numbers is the clear failure.
    """
    num_blocks = min(swap_space_bytes // bytes_per_block, max_useful_blocks)
    needed = num_blocks * bytes_per_block
    spare = host_available_bytes - int(host_total_bytes * HOST_RESERVE_FRACTION)
    if needed and needed > spare:
        kind = "pinned " if is_pinned else ""
        raise KVCacheSizingError(
            f"swap_space asks for {needed / GiB:.2f} GiB of {kind}host memory ({num_blocks} "
            f"blocks), but only {host_available_bytes / GiB:.2f} GiB are available and "
            f"{HOST_RESERVE_FRACTION:.0%} of the host's {host_total_bytes / GiB:.2f} GiB is kept "
            f"for the process and the OS; lower swap_space (0 disables swapping)"
        )
    return num_blocks


def check_device_free(free_bytes: int, total_bytes: int, utilization: float) -> None:
    """Raise if other processes already hold memory that the budget counts on (CUDA)."""
    wanted = int(total_bytes * utilization)
    if free_bytes >= wanted:
        return
    raise KVCacheSizingError(
        f"gpu_memory_utilization {utilization} asks for {wanted / GiB:.2f} GiB of the device's "
        f"{total_bytes / GiB:.2f} GiB, but only {free_bytes / GiB:.2f} GiB were free before the "
        f"model loaded ({(total_bytes - free_bytes) / GiB:.2f} GiB held by other processes and "
        f"this one's CUDA context); "
        f"lower gpu_memory_utilization or free the device"
    )


def practice_warnings(config: EngineConfig) -> list[dict[str, Any]]:
    """Settings that contradict known good practice; each a dict for one warning log line."""
    sched, cache = config.scheduler_config, config.cache_config
    warnings = []
    peak = sched.expected_concurrency
    if peak is not None:
        low, high = TOLERATED_SEQS_PER_REQUEST
        if not low * peak <= sched.max_num_seqs <= high * peak:
            lo, hi = (math.ceil(r * peak) for r in RECOMMENDED_SEQS_PER_REQUEST)
            warnings.append(
                {
                    "check": "max_num_seqs",
                    "max_num_seqs": sched.max_num_seqs,
                    "expected_concurrency": peak,
                    "advice": f"set max_num_seqs to {lo}-{hi} (1.2-1.5x the expected peak): "
                    "fewer queue requests at the peak, more reserve batch slots and KV the "
                    "peak never uses",
                }
            )
    runtime_fraction = 1.0 - cache.gpu_memory_utilization
    if runtime_fraction < MIN_RUNTIME_FRACTION - 1e-9:
        warnings.append(
            {
                "check": "gpu_memory_utilization",
                "gpu_memory_utilization": cache.gpu_memory_utilization,
                "advice": f"only {runtime_fraction:.0%} of device memory is left outside the "
                f"budget; keep at least {MIN_RUNTIME_FRACTION:.0%} (0.9) for the runtime",
            }
        )
    low_bs, high_bs = TUNED_BLOCK_SIZES
    if not low_bs <= cache.block_size <= high_bs:
        warnings.append(
            {
                "check": "block_size",
                "block_size": cache.block_size,
                "advice": f"block sizes {low_bs}-{high_bs} are what the attention kernels "
                "(tiles of 32-64 keys) are tuned and tested at; larger blocks leave half a "
                "block of KV unused per request on average and share prefixes only in whole "
                "blocks (docs/benchmarks.md), smaller ones lengthen every block table",
            }
        )
    return warnings
