"""User-facing `EngineArgs` and the validated, frozen `EngineConfig` derived from them once."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Literal

from asyncengine.model_files import load_hf_config, resolve_model_path

DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's (and torch's) other names
DEVICES = ("auto", "cuda", "cpu")
PREEMPTION_MODES = ("auto", "swap", "recompute")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 8, 1024
GiB = 1 << 30
PROMPT_BYTES_PER_TOKEN = 32  # far above any tokenizer's average: real prompts are never refused
# tokens one step computes when max_num_batched_tokens is not given. Chunked prefill is always
# on, so any budget works; it sets how long a step may run, and every decoding request and every
# prompt of the step waits for the whole step. 2048 tokens are milliseconds on a GPU; on a 2-core
# CPU they are ~230 ms of the 60M llama. 512 served as many tokens/s as 2048 (within 3%) with TTFT
# p50 halved: 362 -> 169 ms at 16 streams, 591 -> 271 ms at 64 (benchmarks/chunk_budget.py,
# docs/benchmarks.md); 256 lost throughput and TTFT at 64 streams
DEFAULT_BATCHED_TOKENS = {"cuda": 2048, "cpu": 512}


@dataclass(frozen=True)
class ModelConfig:
    """The model: where it lives, its Hugging Face config, and how it runs."""

    model: str  # resolved local directory
    tokenizer: str
    hf_config: Any  # transformers.PretrainedConfig
    dtype: str  # "float32" | "float16" | "bfloat16"
    max_model_len: int
    seed: int

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["?"])[0]


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block geometry and how many blocks to make."""

    block_size: int
    gpu_memory_utilization: float
    swap_space_bytes: int
    num_gpu_blocks_override: int | None
    num_cpu_blocks_override: int | None
    enable_prefix_caching: bool
    sliding_window: int | None
    enable_kv_events: bool = False  # only with prefix caching: events follow its index
    # a fixed device KV cache size instead of what gpu_memory_utilization leaves
    kv_cache_memory_bytes: int | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching budgets and the preemption policy."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: Literal["auto", "swap", "recompute"]
    # the operator's stated peak of concurrent requests, checked against max_num_seqs at start
    expected_concurrency: int | None = None
    # a text prompt longer than this (UTF-8 bytes) is refused before it is tokenized
    max_prompt_bytes: int = 1 << 20


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model and the KV cache live and which attention path reads the cache."""

    device: Literal["cuda", "cpu"]
    attention_backend: Literal["torch", "triton"]


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: how many ranks share the model, and how they find each other."""

    tensor_parallel_size: int = 1
    # torch.distributed's rendezvous ("tcp://host:port"); None: a free port on this host
    distributed_init_method: str | None = None
    num_nodes: int = 1  # ranks are split evenly over the nodes; node 0 runs the engine
    # how long a rank waits in a step for another before the engine is declared dead
    distributed_timeout_s: float = 120.0

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.num_nodes


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """How grammars compile: how many at once, how long a caller waits, how much is cached."""

    # compiles run in a pool of this many threads (one xgrammar thread each)
    compile_threads: int = 1
    # a caller waits this long for its grammar's compile, from its start, then gets an error
    max_compile_s: float = 60.0
    # compiled grammars kept for reuse, least recently used evicted past this many bytes
    max_cache_bytes: int = 256 << 20


SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
_DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): a proposer guesses up to
    `num_speculative_tokens` next tokens, the target model checks them all in one forward.

    `ngram` looks the last `prompt_lookup_max` .. `prompt_lookup_min` tokens up in the prompt
    and output so far and proposes what followed them (as in vLLM, one bound given sets the
    other and neither means 5 and 5: a short suffix matches by chance, and its drafts are
    mostly rejected); `draft_model` runs the small model at `model` (same tokenizer), its KV
    in the target's blocks. Speculation is skipped in a step with more than
    `disable_by_batch_size` decoding requests, and for a request whose recent acceptance rate
    is below `min_acceptance_rate` (it is tried again now and then).
    """

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int
    prompt_lookup_max: int = _DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = _DEFAULT_PROMPT_LOOKUP
    model: str | None = None  # the draft model's resolved directory
    disable_by_batch_size: int = 8
    min_acceptance_rate: float = 0.1

    @classmethod
    def from_user(cls, value: dict[str, Any] | str) -> SpeculativeConfig:
        """From vLLM's JSON shape (a dict, or its JSON text); errors name the field."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                _require(False, "speculative_config", f"a JSON object ({exc})", value)
        _require(isinstance(value, dict), "speculative_config", "a JSON object", value)
        assert isinstance(value, dict)
        fields = dict(value)
        known = {f.name for f in dataclasses.fields(cls)}
        for name in fields.keys() - known:
            _require(False, f"speculative_config.{name}", f"one of {sorted(known)}", fields[name])
        _require(
            "num_speculative_tokens" in fields,
            "speculative_config.num_speculative_tokens",
            "given",
            None,
        )
        method = fields.setdefault("method", "draft_model" if "model" in fields else None)
        _one_of("speculative_config.method", method, SPEC_METHODS)
        if method == "draft_model":
            model = fields.get("model")
            _require(
                isinstance(model, str),
                "speculative_config.model",
                "the draft model's directory for method 'draft_model'",
                model,
            )
            fields["model"] = resolve_model_path(str(model))
        else:
            _require(
                fields.get("model") is None,
                "speculative_config.model",
                "unset for method 'ngram' (it needs no model)",
                fields.get("model"),
            )
            low, high = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
            fields["prompt_lookup_min"] = low if low is not None else high
            fields["prompt_lookup_max"] = high if high is not None else low
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if fields[name] is None:
                    fields[name] = _DEFAULT_PROMPT_LOOKUP
        config = cls(**fields)
        config._validate()
        return config

    def _validate(self) -> None:
        k = self.num_speculative_tokens
        _require(
            _is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS,
            "speculative_config.num_speculative_tokens",
            f"an int in [1, {MAX_SPECULATIVE_TOKENS}]",
            k,
        )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        _require(_is_int(low) and low >= 1, "speculative_config.prompt_lookup_min", ">= 1", low)
        _require(
            _is_int(high) and high >= low,
            "speculative_config.prompt_lookup_max",
            f">= prompt_lookup_min ({low})",
            high,
        )
        _require(
            _is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1,
            "speculative_config.disable_by_batch_size",
            ">= 1",
            self.disable_by_batch_size,
        )
        _require(
            0.0 <= self.min_acceptance_rate <= 1.0,
            "speculative_config.min_acceptance_rate",
            "in [0, 1]",
            self.min_acceptance_rate,
        )


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA: adapters resident on the device at once, cached in host memory, max rank."""

    max_loras: int = 1  # device slots: distinct adapters one step may run
    max_lora_rank: int = 16
    max_cpu_loras: int = 1  # loaded adapters kept in host memory (least recently used go)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, derived once from `EngineArgs` and never mutated."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    parallel_config: ParallelConfig = ParallelConfig()
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    lora_config: LoRAConfig | None = None  # None: LoRA adapters are off
    speculative_config: SpeculativeConfig | None = None


def _default_model() -> str:
    from asyncengine import default_model

    return default_model.path()


@dataclass
class EngineArgs:
    """The engine's knobs as users pass them (vLLM's names). See `create_engine_config`.

    `model` defaults to the small model bundled with the package (`asyncengine.default_model`).
    `dtype` also takes vLLM's "half" and "float", and a torch dtype.

    Some of vLLM's arguments are accepted so that vLLM code runs unchanged, though here they
    change nothing or allow only one value:
    - `trust_remote_code`: asyncengine never runs code shipped with a model. It implements
      each model family itself and reads configs and tokenizers with transformers' built-in
      classes, so an architecture it lacks is an error either way.
    - `enforce_eager`: the model always runs eagerly (no CUDA graphs, no torch.compile).
    - `disable_log_stats`: the engine logs no periodic stats (they are in `get_stats()` and
      the server's Prometheus metrics), so there is nothing to turn off.
    - `enable_chunked_prefill`: chunked prefill is always on; False is an error.
    - `pipeline_parallel_size`: pipeline parallelism is not supported; anything but 1 is an
      error. (`tensor_parallel_size` N > 1 splits the model over N ranks: asyncengine/distributed.)
    - `quantization`: quantized weights are not supported; anything but None is an error.

    `speculative_config` is vLLM's: a dict or its JSON text, e.g. `{"method": "ngram",
    "num_speculative_tokens": 5, "prompt_lookup_max": 4}` or `{"model": DRAFT_DIR,
    "num_speculative_tokens": 4}` (see `SpeculativeConfig`).
    """

    model: str = dataclasses.field(default_factory=_default_model)
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0  # GiB of CPU swap blocks
    num_gpu_blocks_override: int | None = None
    num_cpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    preemption_mode: str = "auto"
    enable_prefix_caching: bool = True
    enable_kv_events: bool = False
    attention_backend: str = "auto"
    # accepted for vLLM code (see the class docstring for what each means here)
    trust_remote_code: bool = False
    enforce_eager: bool = False
    disable_log_stats: bool = False
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # tensor parallelism beyond one host (see docs/operations.md): rendezvous, nodes, timeout
    distributed_init_method: str | None = None
    num_nodes: int = 1
    distributed_timeout_s: float = 120.0
    quantization: str | None = None
    expected_concurrency: int | None = None
    # text prompts are measured before tokenizing; default: 32 bytes per token of max_model_len
    max_prompt_bytes: int | None = None
    # structured outputs (docs/operations.md): compile threads (default: one per 4 CPUs, 1-4),
    # a caller's wait for its compile, and the compiled-grammar cache's bound
    grammar_compile_threads: int | None = None
    max_grammar_compile_s: float = 60.0
    max_grammar_cache_bytes: int = 256 << 20
    # multi-LoRA (docs/operations.md): adapters per step, their max rank, host-cached ones
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    speculative_config: dict[str, Any] | str | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def _validate(self) -> None:
        _one_of("dtype", _dtype_name(self.dtype), DTYPES)
        _one_of("device", self.device, DEVICES)
        _one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        bs = self.block_size
        _require(
            isinstance(bs, int) and MIN_BLOCK_SIZE <= bs <= MAX_BLOCK_SIZE and bs & (bs - 1) == 0,
            "block_size",
            f"a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]",
            bs,
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            "in (0, 1]",
            self.gpu_memory_utilization,
        )
        _require(self.swap_space >= 0, "swap_space", ">= 0 (GiB)", self.swap_space)
        _require(self.seed >= 0, "seed", ">= 0", self.seed)
        _require(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        tp = self.tensor_parallel_size
        _require(isinstance(tp, int) and tp >= 1, "tensor_parallel_size", ">= 1", tp)
        _require(
            self.num_nodes >= 1 and tp % self.num_nodes == 0,
            "num_nodes",
            f">= 1 and a divisor of tensor_parallel_size ({tp})",
            self.num_nodes,
        )
        _require(
            self.num_nodes == 1 or self.distributed_init_method is not None,
            "distributed_init_method",
            "tcp://LEADER_HOST:PORT when num_nodes > 1 (every node connects there)",
            self.distributed_init_method,
        )
        _require(
            self.distributed_timeout_s > 0,
            "distributed_timeout_s",
            "> 0 (seconds)",
            self.distributed_timeout_s,
        )
        _require(
            self.pipeline_parallel_size == 1,
            "pipeline_parallel_size",
            "1 (pipeline parallelism is not supported)",
            self.pipeline_parallel_size,
        )
        _require(
            self.enable_chunked_prefill is True,
            "enable_chunked_prefill",
            "True (chunked prefill is always on)",
            self.enable_chunked_prefill,
        )
        _require(
            self.quantization is None,
            "quantization",
            "None (quantized weights are not supported)",
            self.quantization,
        )
        for name in (
            "max_num_batched_tokens",
            "max_model_len",
            "num_gpu_blocks_override",
            "kv_cache_memory_bytes",
            "expected_concurrency",
            "max_prompt_bytes",
            "grammar_compile_threads",
        ):
            value = getattr(self, name)
            _require(value is None or value >= 1, name, ">= 1 or None", value)
        _require(
            self.max_grammar_compile_s > 0,
            "max_grammar_compile_s",
            "> 0 (seconds)",
            self.max_grammar_compile_s,
        )
        _require(
            self.max_grammar_cache_bytes >= 0,
            "max_grammar_cache_bytes",
            ">= 0 (0: no cache)",
            self.max_grammar_cache_bytes,
        )
        _require(
            self.num_cpu_blocks_override is None or self.num_cpu_blocks_override >= 0,
            "num_cpu_blocks_override",
            ">= 0 or None",
            self.num_cpu_blocks_override,
        )

        self._validate_lora()
        if self.max_num_batched_tokens is not None:
            _require(
                self.max_num_batched_tokens >= self.max_num_seqs,
                "max_num_batched_tokens",
                f">= max_num_seqs ({self.max_num_seqs}) so every running request gets a token",
                self.max_num_batched_tokens,
            )

    def _validate_lora(self) -> None:
        _require(self.max_loras >= 1, "max_loras", ">= 1", self.max_loras)
        _require(self.max_lora_rank >= 1, "max_lora_rank", ">= 1", self.max_lora_rank)
        _require(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            "max_cpu_loras",
            f">= max_loras ({self.max_loras}) or None",
            self.max_cpu_loras,
        )

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras or self.max_loras,
        )

    def create_engine_config(self) -> EngineConfig:
        """Validate every field and derive the frozen config (loads the model's config.json)."""
        self._validate()
        model_path = resolve_model_path(self.model)
        hf_config = load_hf_config(model_path)
        max_model_len = _derive_max_model_len(hf_config, self.max_model_len)
        device = _resolve_device(self.device)
        model_config = ModelConfig(
            model=model_path,
            tokenizer=resolve_model_path(self.tokenizer) if self.tokenizer else model_path,
            hf_config=hf_config,
            dtype=_resolve_dtype(_dtype_name(self.dtype), hf_config, device),
            max_model_len=max_model_len,
            seed=self.seed,
        )
        prefix_caching = _prefix_caching(self.enable_prefix_caching, hf_config)
        if self.enable_kv_events and not prefix_caching:
            from asyncengine.logging import get_logger

            get_logger(__name__).warning(
                "kv_events_disabled", reason="KV events follow the prefix cache, which is off"
            )
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            swap_space_bytes=int(self.swap_space * GiB),
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            num_cpu_blocks_override=self.num_cpu_blocks_override,
            enable_prefix_caching=prefix_caching,
            sliding_window=getattr(hf_config, "sliding_window", None) or None,
            enable_kv_events=self.enable_kv_events and prefix_caching,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens
            or max(DEFAULT_BATCHED_TOKENS[device], self.max_num_seqs),
            max_model_len=max_model_len,
            preemption_mode=self.preemption_mode,  # type: ignore[arg-type]
            expected_concurrency=self.expected_concurrency,
            max_prompt_bytes=self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * max_model_len,
        )
        backend = _resolve_attention_backend(self.attention_backend, device)
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_init_method=self.distributed_init_method,
            num_nodes=self.num_nodes,
            distributed_timeout_s=self.distributed_timeout_s,
        )
        _check_tensor_parallel(parallel_config, hf_config, device)
        speculative = self._speculative_config(hf_config, max_model_len)
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            device_config=DeviceConfig(device=device, attention_backend=backend),
            parallel_config=parallel_config,
            structured_outputs_config=StructuredOutputsConfig(
                compile_threads=self.grammar_compile_threads or _default_compile_threads(),
                max_compile_s=self.max_grammar_compile_s,
                max_cache_bytes=self.max_grammar_cache_bytes,
            ),
            lora_config=self._lora_config(),
            speculative_config=speculative,
        )

    def _speculative_config(self, hf_config: Any, max_model_len: int) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        config = SpeculativeConfig.from_user(self.speculative_config)
        _require(
            self.tensor_parallel_size == 1,
            "tensor_parallel_size",
            "1 with speculative_config (speculation runs on one rank only)",
            self.tensor_parallel_size,
        )
        if config.model is not None:
            draft = load_hf_config(config.model)
            _require(
                int(draft.vocab_size) == int(hf_config.vocab_size),
                "speculative_config.model",
                f"a model with the target's vocabulary ({hf_config.vocab_size} tokens)",
                f"{config.model} ({draft.vocab_size} tokens)",
            )
            limit = getattr(draft, "max_position_embeddings", None)
            _require(
                limit is None or limit >= max_model_len,
                "speculative_config.model",
                f"a model with max_position_embeddings >= max_model_len ({max_model_len})",
                f"{config.model} ({limit})",
            )
        return config


@dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's arguments for `AsyncLLMEngine.from_engine_args`: `EngineArgs` plus
    `disable_log_requests`, accepted (the engine logs no line per request)."""

    disable_log_requests: bool = False


def _default_compile_threads() -> int:
    """One compile thread per 4 CPUs, 1 to 4: on 2 cores one compile at a time leaves the
    step a core of its own."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def _dtype_name(dtype: object) -> str:
    """A dtype as its name: "float16" for "float16", "half" or torch.float16."""
    name = str(dtype).removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


def _derive_max_model_len(hf_config: Any, requested: int | None) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None)
    if requested is None:
        if limit is None:
            raise ValueError(
                "EngineArgs.max_model_len must be given: the model config has no "
                "max_position_embeddings"
            )
        return int(limit)
    if limit is not None and requested > limit:
        raise ValueError(
            f"EngineArgs.max_model_len must be <= the model's max_position_embeddings ({limit}), "
            f"got {requested}"
        )
    return requested


def _check_tensor_parallel(parallel: ParallelConfig, hf_config: Any, device: str) -> None:
    """The model must split evenly over the ranks (KV heads may also be replicated)."""
    tp = parallel.tensor_parallel_size
    if tp == 1:
        return
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    rule = f"a divisor of num_attention_heads ({num_heads}) and of intermediate_size "
    rule += f"({hf_config.intermediate_size}), and a divisor or multiple of num_key_value_heads "
    rule += f"({num_kv_heads}) (fewer KV heads than ranks are replicated)"
    fits = num_heads % tp == 0 and int(hf_config.intermediate_size) % tp == 0
    is_even = num_kv_heads % tp == 0 or tp % num_kv_heads == 0
    _require(fits and is_even, "tensor_parallel_size", rule, tp)
    if device == "cuda":
        import torch

        num_gpus = torch.cuda.device_count()
        rule = f"at most {num_gpus} ranks per node (one GPU each)"
        _require(parallel.ranks_per_node <= num_gpus, "tensor_parallel_size", rule, tp)


def _prefix_caching(requested: bool, hf_config: Any) -> bool:
    # a block outside a sliding window holds K/V no later request can reuse whole
    if requested and getattr(hf_config, "sliding_window", None):
        from asyncengine.logging import get_logger

        get_logger(__name__).warning(
            "prefix_caching_disabled", reason="the model uses sliding-window attention"
        )
        return False
    return requested


def _resolve_device(device: str) -> Literal["cuda", "cpu"]:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("EngineArgs.device is 'cuda' but no CUDA device is available")
    return device  # type: ignore[return-value]


def _resolve_attention_backend(backend: str, device: str) -> Literal["torch", "triton"]:
    import importlib.util
    import os

    has_triton = importlib.util.find_spec("triton") is not None
    if backend == "auto":
        # the kernels on CUDA; on CPU they would only run under Triton's (slow) interpreter
        return "triton" if device == "cuda" and has_triton else "torch"
    if backend == "triton":
        _require(
            has_triton, "attention_backend", "'torch' or 'auto' (triton is not installed)", backend
        )
        _require(
            device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1",
            "attention_backend",
            "'torch' or 'auto' on the CPU, unless TRITON_INTERPRET=1 is set (before triton is "
            "imported) to run the kernels in Triton's interpreter",
            backend,
        )
    return backend  # type: ignore[return-value]


def _resolve_dtype(dtype: str, hf_config: Any, device: str) -> str:
    if dtype != "auto":
        return dtype
    if device == "cpu":
        # bf16 where the CPU multiplies it natively (~5-10x the fp32 GEMM rate); elsewhere
        # torch emulates it, slower than float32, and float16 is slow on nearly every CPU
        flag = cpu_bf16_flag()
        chosen = "bfloat16" if flag else "float32"
        reason = f"the CPU has {flag}" if flag else "the CPU has neither amx_bf16 nor avx512_bf16"
        from asyncengine.logging import get_logger

        get_logger(__name__).info("dtype_auto", dtype=chosen, device=device, reason=reason)
        return chosen
    config_dtype = str(getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", ""))
    config_dtype = config_dtype.removeprefix("torch.")
    return config_dtype if config_dtype in ("float16", "bfloat16") else "bfloat16"


def cpu_bf16_flag(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU feature that multiplies bfloat16 natively ("amx_bf16", "avx512_bf16"), or None.

    Read from the kernel's flags; where there are none (not Linux), from torch's cpuinfo.
    """
    try:
        with open(cpuinfo) as f:
            flags_line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags_line = ""
    if flags_line:
        flags = set(flags_line.partition(":")[2].split())
        return next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), None)
    import torch

    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return "amx_bf16"  # every CPU with AMX tiles has AMX-BF16
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "avx512_bf16"
    return None


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, name, "one of " + ", ".join(repr(a) for a in allowed), value)


def _is_int(value: object) -> bool:
    """An int and not a bool (JSON's `true` decodes to True, which is an int in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"EngineArgs.{name} must be {rule}, got {value!r}")
