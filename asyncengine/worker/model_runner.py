"""Executes a `SchedulerOutput`: block moves, one forward over the flattened batch, sampling."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncengine.config import EngineConfig
from asyncengine.core.request import Request
from asyncengine.core.scheduler import SchedulerOutput
from asyncengine.logging import get_logger
from asyncengine.models.loader import get_model
from asyncengine.outputs import Logprobs
from asyncengine.worker.cache_engine import CacheEngine
from asyncengine.worker.forward_context import AttentionMetadata, set_forward_context
from asyncengine.worker.sampler import Sampler

logger = get_logger(__name__)


@dataclass
class ModelRunnerOutput:
    """The token sampled for each request that reached the end of its tokens this step."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)


@dataclass
class _BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sampling_reqs: list[Request]
    logits_indices: torch.Tensor


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler on one device."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device_config.device
        self.dtype: torch.dtype = getattr(torch, config.model_config.dtype)
        self.block_size = config.cache_config.block_size
        torch.manual_seed(config.model_config.seed)
        model: Any = get_model(config.model_config, self.device)
        self.model = model
        attn = model.model.layers[0].self_attn
        self.num_layers = len(model.model.layers)
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.sampler = Sampler(self.device, config.model_config.seed)
        self.cache_engine: CacheEngine | None = None

    # -- KV cache sizing ---------------------------------------------------------------------

    def bytes_per_block(self) -> int:
        return CacheEngine.bytes_per_block(
            self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype
        )

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) for this config; explicit overrides always win."""
        cache, sched = self.config.cache_config, self.config.scheduler_config
        per_block = self.bytes_per_block()
        # no use making more blocks than max_num_seqs full-length requests could ever hold
        max_useful = sched.max_num_seqs * -(-sched.max_model_len // self.block_size)
        num_gpu = cache.num_gpu_blocks_override
        if num_gpu is None:
            free, total = _device_memory(self.device)
            budget = free - total * (1.0 - cache.gpu_memory_utilization) - self._activation_bytes()
            num_gpu = min(max(int(budget // per_block), 0), max_useful)
            logger.info(
                "kv_cache_sized",
                device=self.device,
                free_bytes=free,
                total_bytes=total,
                utilization=cache.gpu_memory_utilization,
                bytes_per_block=per_block,
                num_gpu_blocks=num_gpu,
            )
            if num_gpu == 0:
                raise RuntimeError(
                    f"no memory left for the KV cache on {self.device}: {free / 2**30:.2f} GiB "
                    f"free of {total / 2**30:.2f} GiB at gpu_memory_utilization="
                    f"{cache.gpu_memory_utilization}; raise it or use a smaller model"
                )
        num_cpu = cache.num_cpu_blocks_override
        if num_cpu is None:
            num_cpu = min(cache.swap_space_bytes // per_block, max_useful)
        return num_gpu, num_cpu

    def _activation_bytes(self) -> int:
        # a rough peak for one forward of max_num_batched_tokens: the widest activations
        # (hidden, qkv, gate+up) live at once, plus the logits of every sequence
        cfg = self.config.model_config.hf_config
        tokens = self.config.scheduler_config.max_num_batched_tokens
        width = 4 * cfg.hidden_size + 3 * cfg.intermediate_size
        logits = self.config.scheduler_config.max_num_seqs * cfg.vocab_size * 4
        return tokens * width * self.dtype.itemsize + logits

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_engine = CacheEngine(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            self.dtype,
            self.device,
        )

    # -- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        assert self.cache_engine is not None, "initialize_cache() first"
        self.cache_engine.apply(plan)
        if not plan.scheduled:
            return ModelRunnerOutput()
        batch = self._prepare_inputs(plan)
        with set_forward_context(batch.attn_metadata, self.cache_engine.gpu_cache):
            hidden = self.model(batch.input_ids, batch.positions)
        if not batch.sampling_reqs:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sampled = self.sampler(logits, batch.sampling_reqs)
        ids = [r.request_id for r in batch.sampling_reqs]
        return ModelRunnerOutput(
            sampled_token_ids=dict(zip(ids, sampled.token_ids)),
            logprobs={i: lp for i, lp in zip(ids, sampled.logprobs) if lp is not None},
        )

    def _prepare_inputs(self, plan: SchedulerOutput) -> _BatchInputs:
        # one-token sequences first, so attention can treat them as one padded batch
        num_new = plan.num_scheduled_tokens
        reqs = sorted(plan.scheduled, key=lambda r: num_new[r.request_id] != 1)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        context_lens, seq_lens, tables = [], [], []
        sampling_reqs, logits_indices = [], []
        for req in reqs:
            start, n = req.num_computed_tokens, num_new[req.request_id]
            table = plan.block_tables[req.request_id]
            input_ids += req.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            query_start_loc.append(query_start_loc[-1] + n)
            context_lens.append(start)
            seq_lens.append(start + n)
            tables.append(table)
            if start + n == req.num_tokens:
                sampling_reqs.append(req)
                logits_indices.append(query_start_loc[-1] - 1)
        max_blocks = max(len(t) for t in tables)
        # padding and released entries (outside a sliding window, so masked) read block 0
        padded = [[max(b, 0) for b in t] + [0] * (max_blocks - len(t)) for t in tables]

        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.long),
            block_tables=tensor(padded, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            seq_lens_list=seq_lens,
            num_decodes=sum(1 for r in reqs if num_new[r.request_id] == 1),
            max_seq_len=max(seq_lens),
        )
        return _BatchInputs(
            input_ids=tensor(input_ids, torch.long),
            positions=tensor(positions, torch.long),
            attn_metadata=meta,
            sampling_reqs=sampling_reqs,
            logits_indices=tensor(logits_indices, torch.long),
        )


def _device_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of the device's memory; host memory when the device is the CPU."""
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return int(free), int(total)
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    if "MemAvailable" in info:
        return info["MemAvailable"], info["MemTotal"]
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages // 2, pages
