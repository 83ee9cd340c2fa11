"""The engine's flags, one per EngineArgs field and named as in vLLM (`--max-num-seqs`, ...),
in `--help`'s groups; `serve`, `generate` and `worker` all take them.

Types and defaults are EngineArgs' (config.py); here is what each flag does.
"""

from __future__ import annotations

import argparse
import dataclasses

from asyncengine.config import EngineArgs
from asyncengine.server.flags import FlagGroup, add_flag_groups

MODEL = FlagGroup(
    "engine: model and device",
    "What is loaded, where, and in which dtype.",
    {
        "model": "local Hugging Face model directory, or hub id where a network exists (default: "
        "the small model bundled with asyncengine)",
        "tokenizer": "tokenizer directory when it differs from --model (default: --model's)",
        "dtype": "weights and KV cache dtype: auto, float32, float16, bfloat16 (auto on a CPU: "
        "bfloat16 where it multiplies bf16 natively, AMX-BF16 or AVX512-BF16, else float32)",
        "device": "auto (cuda when available, else cpu), cuda or cpu",
        "attention_backend": "auto (triton on CUDA when it is installed, else torch), torch or "
        "triton",
        "seed": "seed of the engine's random state, for requests without a seed of their own",
    },
)
CACHE = FlagGroup(
    "engine: KV cache and scheduling",
    "How much KV cache there is, how a step is filled, and what bounds a request.",
    {
        "block_size": "tokens per KV cache block: a power of two in [8, 1024]",
        "gpu_memory_utilization": "fraction of device memory the model and KV cache may use",
        "swap_space": "GiB of CPU memory for swapped-out KV blocks",
        "num_gpu_blocks_override": "use exactly this many device KV blocks instead of profiling "
        "(default: as many as --gpu-memory-utilization leaves room for)",
        "kv_cache_memory_bytes": "give the device KV cache exactly this many bytes instead of "
        "what --gpu-memory-utilization leaves: on a CPU host shared with other processes, the "
        "predictable choice (--num-gpu-blocks-override wins over it)",
        "num_cpu_blocks_override": "use exactly this many CPU swap blocks (default: as many as "
        "--swap-space holds)",
        "max_num_seqs": "most requests running in one step",
        "max_num_batched_tokens": "token budget of one step (default: max(512, max_num_seqs) "
        "on a CPU, max(2048, max_num_seqs) on a GPU)",
        "max_model_len": "context length: the most tokens of prompt and output one request may "
        "have (default: the model's max_position_embeddings)",
        "preemption_mode": "what happens to a preempted request's KV: swap (to CPU blocks; "
        "recompute when they are full), recompute (dropped, prefilled again), or auto (as swap, "
        "but a lone request with less than a block computed is recomputed)",
        "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes (off by itself for "
        "sliding-window models)",
        "enable_kv_events": "publish the prefix cache's stored / removed / cleared blocks to "
        "SubscribeKvEvents (SMG's event-driven cache_aware routing) and engine.kv_events()",
        "expected_concurrency": "the peak of concurrent requests you expect: a warning at start-up "
        "if max_num_seqs is far from 1.2-1.5x it (default: no check)",
        "max_prompt_bytes": "a text prompt longer than this many UTF-8 bytes is refused before it "
        "is tokenized (default: 32 per token of max_model_len)",
    },
)
STRUCTURED = FlagGroup(
    "engine: structured outputs",
    "Grammars of json, regex, choice and grammar constraints: their compiles and cache.",
    {
        "grammar_compile_threads": "structured-outputs grammars compile in this many threads at "
        "once (default: one per 4 CPUs, 1 to 4)",
        "max_grammar_compile_s": "a request whose grammar has compiled for this many seconds gets "
        "an error naming its constraint field",
        "max_grammar_cache_bytes": "compiled grammars kept for reuse, the least recently used "
        "evicted past this many bytes; 0: none kept",
    },
)
LORA = FlagGroup(
    "engine: LoRA adapters",
    "PEFT LoRA adapters over the base model, several in one batch (docs/operations.md).",
    {
        "enable_lora": "serve LoRA adapters (PEFT adapter_config.json + "
        "adapter_model.safetensors) on the attention and MLP projections",
        "max_loras": "adapters resident on the device at once: the most distinct adapters one "
        "step runs (a request whose adapter has no slot waits for one)",
        "max_lora_rank": "the highest adapter rank accepted; device slots are sized for it",
        "max_cpu_loras": "adapters kept loaded in host memory, least recently used evicted (and "
        "read again, off the step, when needed) (default: --max-loras)",
    },
)
SPECULATIVE = FlagGroup(
    "engine: speculative decoding",
    "A proposer guesses the next tokens; the model checks them all in one forward.",
    {
        "speculative_config": "vLLM's JSON object: method ngram with num_speculative_tokens, "
        "prompt_lookup_max and prompt_lookup_min, or model DRAFT_DIR with num_speculative_tokens "
        "(a draft model); also disable_by_batch_size (default 8) and min_acceptance_rate "
        "(default 0.1) (default: no speculation)",
    },
)
PARALLELISM = FlagGroup(
    "parallelism",
    "Tensor parallelism over torch.distributed (NCCL on CUDA, gloo on CPU), on one node or "
    "several.",
    {
        "tensor_parallel_size": "split the model over this many ranks (GPUs, or CPU processes), "
        "Megatron-style",
        "num_nodes": "nodes the tensor-parallel ranks are split over; node 0 runs the engine, the "
        "others run `asyncengine worker --node-rank K` with the same flags",
        "distributed_init_method": "tensor parallelism's rendezvous, tcp://HOST:PORT on the leader "
        "(needed with --num-nodes > 1; default: a free port on this host)",
        "distributed_timeout_s": "seconds a rank waits for another inside a step before the engine "
        "is declared dead",
        "pipeline_parallel_size": "vLLM's flag; refused unless 1: pipeline parallelism is not "
        "supported",
    },
)
COMPATIBILITY = FlagGroup(
    "vLLM compatibility",
    "vLLM's flags, accepted so that vLLM command lines run; each says what it does here.",
    {
        "trust_remote_code": "ignored: asyncengine never runs code shipped with a model (it "
        "implements each model family itself), so an architecture it lacks is an error either "
        "way",
        "enforce_eager": "ignored: the model always runs eagerly (no CUDA graphs, no "
        "torch.compile)",
        "disable_log_stats": "ignored: the engine logs no periodic stats to turn off (they are in "
        "the metrics)",
        "enable_chunked_prefill": "honoured as on, its only setting: chunked prefill is always on "
        "and --no-enable-chunked-prefill is refused",
        "quantization": "refused when given: quantized weights are not supported (default: none)",
    },
)
ENGINE_GROUPS = [MODEL, CACHE, STRUCTURED, LORA, SPECULATIVE, PARALLELISM, COMPATIBILITY]


def add_engine_args(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """One `--flag` per EngineArgs field, in ENGINE_GROUPS; returns the groups by title."""
    return add_flag_groups(parser, EngineArgs, ENGINE_GROUPS)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags (no --model: EngineArgs' own default, the bundled model)."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
    if values["model"] is None:
        del values["model"]
    return EngineArgs(**values)
