"""The draft-model proposer: a small model of a supported family, sharing the target's
tokenizer, drafts greedily with its K/V paged in the target's blocks (tensors of its own).

Every forward the target runs, the draft model runs too, over the same tokens and slots, so
its K/V always covers what the target's does (prefill chunks, recompute, prefix-cache hits:
a cached block was filled by such a forward). Swaps and copies move both caches alike. A
request's drafts are then k one-token forwards from its last token on, written into the draft
slots the scheduler reserved; the target's forward rewrites those slots with the same tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from asyncengine.config import EngineConfig
from asyncengine.core.request import Request
from asyncengine.core.scheduler import SchedulerOutput
from asyncengine.model_files import load_hf_config
from asyncengine.models.loader import get_model
from asyncengine.worker.attention import set_attention_backend
from asyncengine.worker.cache_engine import CacheEngine
from asyncengine.worker.cpu_linear import pack_linear_layers
from asyncengine.worker.forward_context import AttentionMetadata, set_forward_context
from asyncengine.worker.proposers import ForwardInputs, Proposer


class DraftModelProposer(Proposer):
    """Greedy drafts from the model at `speculative_config.model` (so the draft distribution
    is a point mass, as the rejection sampler assumes)."""

    method = "draft_model"

    def __init__(self, config: EngineConfig) -> None:
        spec = config.speculative_config
        assert spec is not None and spec.model is not None
        model_config = dataclasses.replace(
            config.model_config, model=spec.model, hf_config=load_hf_config(spec.model)
        )
        self.device = config.device_config.device
        self.dtype: torch.dtype = getattr(torch, model_config.dtype)
        self.block_size = config.cache_config.block_size
        self.attention_backend = config.device_config.attention_backend
        model: Any = get_model(model_config, self.device)
        set_attention_backend(model, self.attention_backend)
        if self.device == "cpu":
            pack_linear_layers(model)
        self.model = model
        attn = model.model.layers[0].self_attn
        self.num_layers = len(model.model.layers)
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.cache: CacheEngine | None = None

    def bytes_per_block(self) -> int:
        return CacheEngine.bytes_per_block(
            self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype
        )

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache = CacheEngine(
            self.num_layers, self.num_kv_heads, self.head_dim, self.block_size,
            num_gpu_blocks, num_cpu_blocks, self.dtype, self.device,
            use_triton_kernels=self.attention_backend == "triton",
        )  # fmt: skip

    def apply_block_moves(self, plan: SchedulerOutput) -> None:
        assert self.cache is not None, "initialize_cache() first"
        self.cache.apply(plan)

    def observe(self, inputs: ForwardInputs) -> None:
        # the metadata's scratch holds what the target's layers computed for themselves
        meta = dataclasses.replace(inputs.attn_metadata, scratch={})
        self._forward(inputs.input_ids, inputs.positions, meta)

    def propose(
        self, reqs: list[Request], num_spec_tokens: list[int], block_tables: list[list[int]]
    ) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        last = [req.token_ids[-1] for req in reqs]
        for step in range(max(num_spec_tokens, default=0)):
            rows = [i for i, k in enumerate(num_spec_tokens) if k > step]
            # a request's last token sits at its first uncomputed position
            positions = [reqs[i].num_computed_tokens + step for i in rows]
            meta = self._decode_metadata(positions, [block_tables[i] for i in rows])
            input_ids = self._tensor([last[i] for i in rows], torch.long)
            hidden = self._forward(input_ids, self._tensor(positions, torch.long), meta)
            next_ids = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for i, token_id in zip(rows, next_ids):
                drafts[i].append(token_id)
                last[i] = token_id
        return drafts

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        assert self.cache is not None, "initialize_cache() first"
        with set_forward_context(meta, self.cache.gpu_cache):
            hidden: torch.Tensor = self.model(input_ids, positions)
        return hidden

    def _decode_metadata(self, positions: list[int], tables: list[list[int]]) -> AttentionMetadata:
        """One token per row at `positions`, written to its slot there."""
        bs = self.block_size
        max_blocks = max(len(t) for t in tables)
        padded = [[max(b, 0) for b in t] + [0] * (max_blocks - len(t)) for t in tables]
        seq_lens = [p + 1 for p in positions]
        return AttentionMetadata(
            slot_mapping=self._tensor(
                [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)], torch.long
            ),
            block_tables=self._tensor(padded, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            query_start_loc=list(range(len(positions) + 1)),
            context_lens=positions,
            seq_lens_list=seq_lens,
            num_decodes=len(positions),
            max_seq_len=max(seq_lens),
        )

    def _tensor(self, values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)
