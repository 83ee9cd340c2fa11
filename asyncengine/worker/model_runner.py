"""Executes a `SchedulerOutput`: block moves, one forward over the flattened batch, sampling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from asyncengine.config import EngineConfig
from asyncengine.core.request import Request
from asyncengine.core.scheduler import SchedulerOutput
from asyncengine.core.spec_decode import SpecResult
from asyncengine.distributed.parallel_state import TensorParallelGroup
from asyncengine.logging import get_logger
from asyncengine.lora.layers import LoRABatch, LoRAStacks, lora_segments
from asyncengine.models.loader import get_model
from asyncengine.outputs import RawLogprobs
from asyncengine.sampling_params import SamplingParams
from asyncengine.worker import kv_sizing
from asyncengine.worker.attention import attends_as_decodes, set_attention_backend
from asyncengine.worker.cache_engine import CacheEngine
from asyncengine.worker.cpu_linear import pack_linear_layers
from asyncengine.worker.forward_context import AttentionMetadata, set_forward_context
from asyncengine.worker.proposers import ForwardInputs, Proposer
from asyncengine.worker.rejection_sampler import verify
from asyncengine.worker.sampler import Grammars, Sampler, prompt_logprobs

# prompt positions scored at once: bounds the [rows, vocab] logits of a long prompt
_PROMPT_LOGITS_CHUNK = 512

logger = get_logger(__name__)


@dataclass
class ModelRunnerOutput:
    """The token sampled for each request that reached the end of its tokens this step."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, RawLogprobs] = field(default_factory=dict)
    # request id -> what failed in that request's own sampling (it gets no token)
    failures: dict[str, str] = field(default_factory=dict)
    # request id -> (index of the first prompt token scored, one entry per token from there)
    prompt_logprobs: dict[str, tuple[int, list[RawLogprobs]]] = field(default_factory=dict)
    # speculative decoding: requests whose drafts were checked (the token sampled after the
    # accepted ones is in `sampled_token_ids`, its logprobs in `logprobs`), and the logprobs
    # of their accepted drafts
    spec_results: dict[str, SpecResult] = field(default_factory=dict)
    spec_logprobs: dict[str, list[RawLogprobs]] = field(default_factory=dict)


@dataclass
class _PromptRows:
    """The rows of one request's scheduled prompt positions whose next token is scored."""

    req: Request
    first_row: int
    first_position: int
    num_rows: int


@dataclass
class _SpecRows:
    """One request's rows of a speculative decode: its last token, then its drafts."""

    req: Request
    first_row: int
    drafts: list[int]


@dataclass
class _BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sampling_reqs: list[Request]
    logits_indices: torch.Tensor
    prompt_rows: list[_PromptRows] = field(default_factory=list)
    lora: LoRABatch | None = None
    spec_rows: list[_SpecRows] = field(default_factory=list)


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler on one device.

    Under tensor parallelism (`tp`) each rank has one, over its shard of the model and of the
    KV cache; asyncengine/distributed drives the others from the driver's.
    """

    def __init__(self, config: EngineConfig, tp: TensorParallelGroup | None = None) -> None:
        self.config = config
        self.device = config.device_config.device
        self.dtype: torch.dtype = getattr(torch, config.model_config.dtype)
        self.block_size = config.cache_config.block_size
        # (free, total, reserved, allocated) before the weights load: the profile's baseline
        self._baseline: tuple[int, int, int, int] | None = None
        if self.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
            self._baseline = (int(free), int(total), reserved, allocated)
        torch.manual_seed(config.model_config.seed)
        model: Any = get_model(config.model_config, self.device, tp)
        set_attention_backend(model, config.device_config.attention_backend)
        if self.device == "cpu":
            pack_linear_layers(model)
        self.model = model
        attn = model.model.layers[0].self_attn
        self.num_layers = len(model.model.layers)
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.sampler = Sampler(self.device, config.model_config.seed)
        self.proposer = _make_proposer(config)
        self.cache_engine: CacheEngine | None = None
        lora = config.lora_config
        self.lora_stacks = None if lora is None else LoRAStacks(
            model, lora.max_loras, lora.max_lora_rank, self.dtype, self.device, tp
        )  # fmt: skip

    # -- KV cache sizing ---------------------------------------------------------------------

    def bytes_per_block(self) -> int:
        """Of the target's K/V, and the draft model's in the same block if there is one."""
        num_bytes = CacheEngine.bytes_per_block(
            self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype
        )
        return num_bytes + (self.proposer.bytes_per_block() if self.proposer else 0)

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) for this config; explicit overrides always win.

        Fails here, at start-up and with the numbers, when the swap pool does not fit in host
        memory or the device pool cannot hold one max_model_len request.
        """
        cache, sched = self.config.cache_config, self.config.scheduler_config
        per_block = self.bytes_per_block()
        # what max_num_seqs full-length requests could ever hold: more serves only the prefix
        # cache, which an automatic size leaves out (the host's memory is shared on a CPU)
        max_useful = sched.max_num_seqs * -(-sched.max_model_len // self.block_size)
        num_cpu = cache.num_cpu_blocks_override
        if num_cpu is None:
            host_free, host_total = kv_sizing.host_memory()
            num_cpu = kv_sizing.num_swap_blocks(
                cache.swap_space_bytes, per_block, max_useful, host_free, host_total,
                is_pinned=self.device == "cuda",
            )  # fmt: skip
        num_gpu = cache.num_gpu_blocks_override
        if num_gpu is None and cache.kv_cache_memory_bytes is not None:
            num_gpu = self._fixed_num_blocks(cache.kv_cache_memory_bytes, per_block, max_useful)
            logger.info(
                "kv_cache_sized",
                kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
                bytes_per_block=per_block,
                num_gpu_blocks=num_gpu,
                num_cpu_blocks=num_cpu,
            )
        if num_gpu is None:
            if self.device == "cuda":
                breakdown = self._profile_cuda(per_block)
            else:  # the swap pool is host memory too: it comes out of the same budget
                breakdown = self._estimate_cpu(per_block, num_cpu * per_block)
            num_gpu = min(breakdown.num_blocks, max_useful)
            logger.info(
                "kv_cache_sized",
                **breakdown.log_fields(),
                kv_cache_gib=round(num_gpu * breakdown.bytes_per_block / kv_sizing.GiB, 3),
                num_gpu_blocks=num_gpu,
                num_cpu_blocks=num_cpu,
                capped_at_max_useful=breakdown.num_blocks > max_useful,
                max_len_requests_at_once=num_gpu
                // kv_sizing.blocks_per_request(
                    sched.max_model_len, self.block_size, cache.sliding_window
                ),
            )
            kv_sizing.check_one_request_fits(
                breakdown.describe(),
                num_gpu, self.block_size, sched.max_model_len, cache.sliding_window,
            )  # fmt: skip
        return num_gpu, num_cpu

    def _fixed_num_blocks(self, kv_bytes: int, per_block: int, max_useful: int) -> int:
        """Blocks of the size asked for (kv_cache_memory_bytes), whatever else holds memory.
        With prefix caching the blocks past what running requests can use hold cached prefixes
        of finished ones, so only without it is the size capped at `max_useful`."""
        cache, sched = self.config.cache_config, self.config.scheduler_config
        num_blocks = kv_bytes // per_block
        if not cache.enable_prefix_caching:
            num_blocks = min(num_blocks, max_useful)
        kv_sizing.check_one_request_fits(
            f"kv_cache_memory_bytes {kv_bytes} at {per_block} bytes per block",
            num_blocks, self.block_size, sched.max_model_len, cache.sliding_window,
        )  # fmt: skip
        return num_blocks

    def _weights_bytes(self) -> int:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        if self.lora_stacks is not None:
            tensors += [*self.lora_stacks.a.values(), *self.lora_stacks.b.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _estimate_cpu(self, per_block: int, swap_bytes: int) -> kv_sizing.MemoryBreakdown:
        # host memory has no allocator statistics to profile with: the rule is the same, with
        # "available" memory and an estimated activation peak
        available, total = kv_sizing.host_memory()
        weights = self._weights_bytes()
        config = self.config
        activation = kv_sizing.estimate_activation_bytes(
            config.model_config.hf_config, config.scheduler_config, self.dtype.itemsize
        )
        return kv_sizing.MemoryBreakdown(
            device="cpu",
            total_bytes=total,
            gpu_memory_utilization=config.cache_config.gpu_memory_utilization,
            weights_bytes=weights,
            activation_peak_bytes=activation,
            non_torch_bytes=max(total - available - weights, 0),
            swap_bytes=swap_bytes,
            bytes_per_block=per_block,
            is_activation_measured=False,
        )

    def _profile_cuda(self, per_block: int) -> kv_sizing.MemoryBreakdown:
        """Measure weights, the activation peak of the largest batch, and non-torch memory."""
        assert self._baseline is not None
        base_free, total, base_reserved, base_allocated = self._baseline
        cache = self.config.cache_config
        kv_sizing.check_device_free(base_free, total, cache.gpu_memory_utilization)
        weights = torch.cuda.memory_allocated() - base_allocated
        peak = self.profile_forward()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        # memory the process holds outside torch's allocator, grown since start-up
        non_torch = (total - free - torch.cuda.memory_reserved()) - (
            total - base_free - base_reserved
        )
        return kv_sizing.MemoryBreakdown(
            device="cuda",
            total_bytes=total,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            weights_bytes=weights,
            activation_peak_bytes=peak,
            non_torch_bytes=max(non_torch, 0),
            swap_bytes=0,
            bytes_per_block=per_block,
            is_activation_measured=True,
        )

    @torch.inference_mode()
    def profile_forward(self) -> int:
        """Run the largest batches the scheduler can form on a throwaway cache.

        Two shapes: max_num_batched_tokens spread over up to max_num_seqs fresh prompts, and
        one chunk of that many tokens at the end of a max_model_len prompt (the widest
        attention). Returns the peak activation bytes on CUDA (0 elsewhere: nothing to read).
        """
        sched = self.config.scheduler_config
        num_tokens = sched.max_num_batched_tokens
        num_seqs = min(sched.max_num_seqs, num_tokens)
        chunk = min(num_tokens, sched.max_model_len)
        # (context, new tokens) per sequence
        base, extra = divmod(num_tokens, num_seqs)
        spread = [base + (i < extra) for i in range(num_seqs)]
        shapes = [[(0, n) for n in spread], [(sched.max_model_len - chunk, chunk)]]
        bs = self.block_size
        num_blocks = max(sum(-(-(c + n) // bs) for c, n in shape) for shape in shapes)
        caches = [
            torch.zeros((2, num_blocks, bs, self.num_kv_heads, self.head_dim), dtype=self.dtype,
                        device=self.device)
            for _ in range(self.num_layers)
        ]  # fmt: skip
        is_cuda = self.device == "cuda"
        if is_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if is_cuda else 0
        for shape in shapes:
            self._dummy_step(shape, caches)
        if not is_cuda:
            return 0
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    def _dummy_step(self, shape: list[tuple[int, int]], caches: list[torch.Tensor]) -> None:
        plan, next_block = SchedulerOutput(), 0
        for i, (context, num_new) in enumerate(shape):
            req = Request(f"profile-{i}", [0] * (context + num_new), SamplingParams(temperature=0))
            req.num_computed_tokens = context
            num_blocks = -(-(context + num_new) // self.block_size)
            plan.add(req, num_new, list(range(next_block, next_block + num_blocks)))
            next_block += num_blocks
        batch = self._prepare_inputs(plan)
        with set_forward_context(batch.attn_metadata, caches):
            hidden = self.model(batch.input_ids, batch.positions)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        self.sampler(logits, batch.sampling_reqs)

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
            use_triton_kernels=self.config.device_config.attention_backend == "triton",
        )
        if self.proposer is not None:
            self.proposer.initialize_cache(num_gpu_blocks, num_cpu_blocks)

    # -- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(
        self, plan: SchedulerOutput, grammars: Grammars | None = None
    ) -> ModelRunnerOutput:
        """`grammars` gives the token masks of constrained requests (structured outputs); its
        masks are filled while the forward runs (on CUDA the forward is still in flight)."""
        assert self.cache_engine is not None, "initialize_cache() first"
        self.cache_engine.apply(plan)
        self.load_loras(plan.lora_loads)
        if self.proposer is not None:
            self.proposer.apply_block_moves(plan)
        if not plan.scheduled:
            return ModelRunnerOutput()
        batch = self._prepare_inputs(plan, self._propose(plan))
        with set_forward_context(batch.attn_metadata, self.cache_engine.gpu_cache, batch.lora):
            hidden = self.model(batch.input_ids, batch.positions)
        if self.proposer is not None:
            self.proposer.observe(
                ForwardInputs(batch.input_ids, batch.positions, batch.attn_metadata)
            )
        output = ModelRunnerOutput()
        for rows in batch.prompt_rows:
            try:
                output.prompt_logprobs[rows.req.request_id] = self._score_prompt(hidden, rows)
            except Exception as exc:  # this request's failure only
                output.failures[rows.req.request_id] = repr(exc)
        # the sampling rows' masks first: verification waits on the forward's results
        masks = None
        if grammars is not None and batch.sampling_reqs:
            masks = grammars.fill_masks(batch.sampling_reqs)
        if batch.spec_rows:
            self._verify(hidden, batch.spec_rows, output, grammars)
        if not batch.sampling_reqs:
            return output
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        sampled = self.sampler(logits, batch.sampling_reqs, masks)
        ids = [r.request_id for r in batch.sampling_reqs]
        output.failures.update({ids[row]: repr(exc) for row, exc in sampled.failures.items()})
        failures = output.failures
        output.sampled_token_ids.update(
            (i, t) for i, t in zip(ids, sampled.token_ids) if i not in failures
        )
        output.logprobs.update(
            (i, lp) for i, lp in zip(ids, sampled.logprobs) if lp is not None and i not in failures
        )
        return output

    def load_loras(self, loads: dict[int, Any]) -> None:
        """Copy adapters (host `LoRAWeights`) into their device slots."""
        for slot, weights in loads.items():
            assert self.lora_stacks is not None, "an adapter to load, and LoRA is off"
            self.lora_stacks.load(slot, weights)

    def _propose(self, plan: SchedulerOutput) -> dict[str, list[int]]:
        """Drafts of the requests with draft slots this step: the plan's own (prompt lookup
        runs in the scheduler), else the proposer's (none proposed are left out)."""
        if self.proposer is None or not plan.num_spec_tokens:
            return plan.spec_drafts
        reqs = [r for r in plan.scheduled if r.request_id in plan.num_spec_tokens]
        drafts = self.proposer.propose(
            reqs,
            [plan.num_spec_tokens[r.request_id] for r in reqs],
            [plan.block_tables[r.request_id] for r in reqs],
        )
        return {r.request_id: d for r, d in zip(reqs, drafts) if d}

    def _verify(
        self,
        hidden: torch.Tensor,
        spec_rows: list[_SpecRows],
        output: ModelRunnerOutput,
        grammars: Grammars | None,
    ) -> None:
        """Check each speculating request's drafts against the target's rows (a constrained
        one's under its grammar, stepped over the drafts it keeps)."""
        rows = [r.first_row + i for r in spec_rows for i in range(len(r.drafts) + 1)]
        logits = self.model.compute_logits(hidden[rows])
        first = 0
        for spec in spec_rows:
            request_id, num_rows = spec.req.request_id, len(spec.drafts) + 1
            try:
                grammar = None if grammars is None else grammars.for_drafts(spec.req)
                verified = verify(
                    self.sampler, logits[first : first + num_rows], spec.req, spec.drafts, grammar
                )
            except Exception as exc:  # this request's failure only
                output.failures[request_id] = repr(exc)
                continue
            finally:
                first += num_rows
            output.sampled_token_ids[request_id] = verified.token_ids[-1]
            output.spec_results[request_id] = SpecResult(
                len(spec.drafts), verified.accepted_token_ids
            )
            if verified.logprobs is not None:
                output.logprobs[request_id] = verified.logprobs[-1]
                output.spec_logprobs[request_id] = verified.logprobs[:-1]

    def _score_prompt(
        self, hidden: torch.Tensor, rows: _PromptRows
    ) -> tuple[int, list[RawLogprobs]]:
        """Prompt logprobs of the tokens after `rows`' positions, a chunk of rows at a time."""
        req, num_top = rows.req, rows.req.sampling_params.prompt_logprobs
        assert num_top is not None
        first_target = rows.first_position + 1
        targets = req.token_ids[first_target : first_target + rows.num_rows]
        entries: list[RawLogprobs] = []
        for start in range(0, rows.num_rows, _PROMPT_LOGITS_CHUNK):
            stop = min(start + _PROMPT_LOGITS_CHUNK, rows.num_rows)
            logits = self.model.compute_logits(
                hidden[rows.first_row + start : rows.first_row + stop]
            )
            target_ids = torch.tensor(targets[start:stop], dtype=torch.long, device=self.device)
            entries += prompt_logprobs(logits, target_ids, num_top)
        return first_target, entries

    def _prepare_inputs(
        self, plan: SchedulerOutput, drafts: dict[str, list[int]] | None = None
    ) -> _BatchInputs:
        """`drafts`: speculative tokens to put after some requests' one token, all checked."""
        drafts = drafts or {}
        num_new = plan.num_scheduled_tokens
        if drafts:
            num_new = {i: n + len(drafts.get(i, ())) for i, n in num_new.items()}

        # one-token sequences first, then the short queries attention treats as decodes too
        # (verified drafts), then the rest; by adapter within each, so an adapter's rows make
        # few segments
        def order(req: Request) -> tuple[int, int]:
            n = num_new[req.request_id]
            group = 0 if n == 1 else 1 if attends_as_decodes(n, req.num_computed_tokens + n) else 2
            return group, req.lora_int_id

        reqs = sorted(plan.scheduled, key=order)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        context_lens, seq_lens, tables = [], [], []
        sampling_reqs, logits_indices = [], []
        prompt_rows = []
        spec_rows = []
        for req in reqs:
            start, n = req.num_computed_tokens, num_new[req.request_id]
            table = plan.block_tables[req.request_id]
            req_drafts = drafts.get(req.request_id)
            input_ids += req.token_ids[start : start + n]
            if req_drafts:
                input_ids += req_drafts
                spec_rows.append(_SpecRows(req, query_start_loc[-1], req_drafts))
            positions += range(start, start + n)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            query_start_loc.append(query_start_loc[-1] + n)
            context_lens.append(start)
            seq_lens.append(start + n)
            tables.append(table)
            if not req_drafts and start + n == req.num_tokens:
                sampling_reqs.append(req)
                logits_indices.append(query_start_loc[-1] - 1)
            # a position scores the prompt token after it; forked samples leave it to sample 0
            num_scored = min(start + n, req.num_prompt_tokens - 1) - start
            is_scored = req.sampling_params.prompt_logprobs is not None and req.sample_index == 0
            if is_scored and num_scored > 0:
                row = query_start_loc[-2]
                prompt_rows.append(_PromptRows(req, row, start, num_scored))
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
            prompt_rows=prompt_rows,
            lora=self._lora_batch(plan, reqs, num_new),
            spec_rows=spec_rows,
        )

    def _lora_batch(
        self, plan: SchedulerOutput, reqs: list[Request], num_new: dict[str, int]
    ) -> LoRABatch | None:
        """Each row's adapter slot; `num_new` counts a request's rows, its drafts included."""
        if self.lora_stacks is None or not plan.lora_slots:
            return None
        slots = plan.lora_slots
        row_slots = []
        for req in reqs:
            row_slots += [slots.get(req.lora_int_id, -1)] * num_new[req.request_id]
        return self.lora_batch(lora_segments(row_slots), len(row_slots))

    def lora_batch(self, segments: list[tuple[int, int, int]], num_rows: int) -> LoRABatch | None:
        """The forward's LoRA rows (`segments` of `num_rows`); None when no adapter runs."""
        if self.lora_stacks is None or not segments:
            return None
        row_slots = None
        # the Triton kernels where attention runs them (CUDA), else grouped matmuls
        if self.config.device_config.attention_backend == "triton":
            slots = torch.full((num_rows,), -1, dtype=torch.int32)
            for start, end, slot in segments:
                slots[start:end] = slot
            row_slots = slots.to(self.device)
        return LoRABatch(self.lora_stacks, segments, row_slots)


def _make_proposer(config: EngineConfig) -> Proposer | None:
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":  # prompt lookup is the scheduler's
        return None
    from asyncengine.worker.draft_model import DraftModelProposer

    return DraftModelProposer(config)
