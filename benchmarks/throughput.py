"""Offline throughput: asyncengine vs. Hugging Face `generate` vs. HF continuous batching, on CPU.

Three systems run the same requests on the same model, dtype and torch thread count:

- asyncengine: `LLM.generate`, one `SamplingParams(max_tokens=n_i, ignore_eos=True)` per request.
- hf-static: `model.generate` on static, left-padded batches of `--batch-size` requests. A batch
  runs until its longest request is done; only the tokens each request asked for are counted.
- hf-cb: transformers' continuous batching with its paged KV cache. `generate_batch` takes one
  `max_new_tokens` for all requests, so it serves the uniform workload; on the mixed workload the
  requests go through the same manager's `add_request(max_new_tokens=n_i)`.

Workloads use random token ids (no tokenizer), lengths drawn from `--seed`: `mixed` (prompt and
output lengths uniform in the given ranges) and `uniform` (fresh prompts, one output length).
Each (system, workload) pair gets an untimed warm-up on separate prompts, so no prefix cache helps.
Then the workload is timed twice (`--passes 2`, the default): the first pass, then a second on
fresh prompts of the same lengths, which meets the same batch shapes; `1st/2nd` is what a
server's first encounter with each batch shape costs (issue 27: once 0.5).

`--dtype` takes a list (`float32,bfloat16,auto`; `auto` is the engine's default on this machine,
run once if it equals another entry, and HF runs in the same dtype). `--rounds N` measures each
(dtype, workload) N times, the systems alternating (ABBA) so that load drifting on a shared box
hits them alike; the table gives medians and the range of the per-round ratios.

    python benchmarks/throughput.py --quick                     # smoke test, < 1 min
    python benchmarks/throughput.py --make-model medium --threads 2 --json
    python benchmarks/throughput.py --make-model 60m --systems asyncengine,hf-static \
        --workloads mixed --num-requests 48 --min-prompt 8 --max-prompt 160 --min-output 8 \
        --max-output 128 --dtype float32,bfloat16,auto --rounds 3 --threads 2   # issue 15
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import random
import resource
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

SYSTEMS = ("asyncengine", "hf-static", "hf-cb")
WORKLOADS = ("mixed", "uniform")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
AUTO = "auto"  # the engine's own choice (EngineArgs(dtype="auto")), resolved before the runs

# Llama config overrides for `--make-model`. tiny: ~1.1M params (mostly the 8192-row embedding and
# LM head), so step time is Python overhead. medium: ~58M params, so step time is the forward pass.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 8192,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "medium": {
        "vocab_size": 32000,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
}
# `--make-model` presets built by asyncengine.testing.make_sized_llama(hidden_size, num_layers).
# 60m: ~58M params (hidden 768, 8 layers, 12 heads, 3 KV heads, MLP 2304, vocab 2048), the
# model of issue 15.
SIZED_PRESETS: dict[str, tuple[int, int]] = {"60m": (768, 8)}

# `--quick` replaces these defaults (explicit flags still win): a smoke test well under a minute.
QUICK_DEFAULTS: dict[str, Any] = {
    "num_requests": 16,
    "min_prompt": 8,
    "max_prompt": 64,
    "min_output": 4,
    "max_output": 32,
    "batch_size": 8,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 256,
    "warmup_requests": 2,
}


@dataclass(frozen=True)
class Workload:
    """A list of token-id prompts and the exact number of tokens to generate for each."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def is_uniform(self) -> bool:
        return len(set(self.output_lens)) == 1


@dataclass(frozen=True)
class BenchConfig:
    """Everything the runners share, derived once from the command line."""

    model_dir: Path
    dtype: str
    threads: int
    max_model_len: int  # the engine's; room for the longest request, not the model's 2048
    batch_size: int
    hf_order: str
    max_num_seqs: int
    max_num_batched_tokens: int
    hf_page_size: int
    seed: int


@dataclass
class Result:
    """One (system, workload) measurement; `outputs` stays out of the JSON."""

    system: str
    workload: str
    dtype: str = ""
    round: int = 0
    api: str = ""
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    wall_s: float = float("nan")
    gen_tok_s: float = float("nan")  # the first timed pass
    second_pass_tok_s: float | None = None  # the same lengths again, fresh prompts
    total_tok_s: float = float("nan")
    speedup_of_asyncengine: float | None = None
    other_cores: float | None = None
    # generated tokens per CPU second of this process: less moved by other jobs than wall time
    # (with one torch thread it is the work itself; with more it also counts OpenMP spin-waits)
    gen_tok_per_cpu_s: float | None = None
    cpu_speedup_of_asyncengine: float | None = None
    match_ref: str | None = None
    seq_match: float | None = None
    token_match: float | None = None
    error: str | None = None
    outputs: list[list[int]] | None = field(default=None, repr=False)


class Runner(Protocol):
    """A loaded system: `generate` returns generated ids per request, in request order."""

    def api(self, workload: Workload) -> str: ...

    def generate(self, workload: Workload) -> list[list[int]]: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------------------------
# Workloads


def sample_prompts(
    rng: random.Random, token_ids: Sequence[int], lens: Sequence[int]
) -> list[list[int]]:
    """Random prompts of the given lengths over `token_ids`."""
    return [rng.choices(token_ids, k=n) for n in lens]


def make_workloads(args: argparse.Namespace, token_ids: Sequence[int]) -> dict[str, Workload]:
    """The timed workloads and, under `warmup-<name>`, their warm-ups (distinct prompts, short)."""
    rng = random.Random(args.seed)
    n = args.num_requests
    prompt_lens = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(n)]
    output_lens = [rng.randint(args.min_output, args.max_output) for _ in range(n)]
    uniform_len = args.uniform_output or (args.min_output + args.max_output) // 2
    # Fresh prompts per workload: a prefix cache must not carry one run's prompts into the next.
    workloads = {
        "mixed": Workload("mixed", sample_prompts(rng, token_ids, prompt_lens), output_lens),
        "uniform": Workload(
            "uniform", sample_prompts(rng, token_ids, prompt_lens), [uniform_len] * n
        ),
    }
    # the second pass: the same lengths (so the same batch shapes), fresh prompts
    for name, wl in list(workloads.items()):
        again = sample_prompts(rng, token_ids, [len(p) for p in wl.prompts])
        workloads[f"again-{name}"] = Workload(f"again-{name}", again, wl.output_lens)
    num_warm = max(1, min(args.warmup_requests, n))
    for name, wl in [(k, v) for k, v in workloads.items() if not k.startswith("again-")]:
        warm_out = [min(8, m) for m in wl.output_lens[:num_warm]]
        if wl.is_uniform:
            warm_out = [min(8, uniform_len)] * num_warm
        warm_prompts = sample_prompts(rng, token_ids, prompt_lens[:num_warm])
        workloads[f"warmup-{name}"] = Workload(f"warmup-{name}", warm_prompts, warm_out)
    return workloads


# ----------------------------------------------------------------------------------------------
# Systems


class AsyncEngineRunner:
    """asyncengine's offline, vLLM-shaped `LLM` API."""

    def __init__(self, cfg: BenchConfig) -> None:
        from asyncengine import LLM, SamplingParams

        self._sampling_params = SamplingParams
        self._llm = LLM(
            model=str(cfg.model_dir),
            dtype=cfg.dtype,
            device="cpu",
            seed=0,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
        )

    def api(self, workload: Workload) -> str:
        return "LLM.generate"

    def generate(self, workload: Workload) -> list[list[int]]:
        params = [
            self._sampling_params(temperature=0.0, max_tokens=n, ignore_eos=True)
            for n in workload.output_lens
        ]
        outs = self._llm.generate(workload.prompts, params, use_tqdm=False)
        # A request the engine rejects comes back with `error` set instead of raising.
        errors = {err for out in outs if (err := getattr(out, "error", None))}
        if errors:
            raise RuntimeError(f"engine rejected requests: {sorted(errors)[:3]}")
        return [list(out.outputs[0].token_ids) for out in outs]

    def close(self) -> None:
        del self._llm


def load_hf_model(cfg: BenchConfig) -> Any:
    """The HF model in eval mode, with EOS cleared so that no request stops early (ignore_eos)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        cfg.model_dir, dtype=DTYPES[cfg.dtype], attn_implementation="sdpa"
    ).eval()
    # `generate` fills unset fields from the model's generation config, so clear EOS at the source.
    model.generation_config.eos_token_id = None
    return model


class HFStaticRunner:
    """`model.generate` over static left-padded batches, greedy."""

    def __init__(self, cfg: BenchConfig) -> None:
        self._cfg = cfg
        self._model = load_hf_model(cfg)
        pad_id = self._model.config.pad_token_id
        self._pad_id = 0 if pad_id is None else int(pad_id)

    def api(self, workload: Workload) -> str:
        return f"generate bs={self._cfg.batch_size} {self._cfg.hf_order}"

    def generate(self, workload: Workload) -> list[list[int]]:
        order = list(range(len(workload.prompts)))
        if self._cfg.hf_order == "sorted":
            # Offline knowledge a server would not have: group similar lengths to cut padding.
            order.sort(key=lambda i: len(workload.prompts[i]) + workload.output_lens[i])
        outputs: list[list[int]] = [[] for _ in order]
        for start in range(0, len(order), self._cfg.batch_size):
            idx = order[start : start + self._cfg.batch_size]
            batch = self._generate_batch(
                [workload.prompts[i] for i in idx], [workload.output_lens[i] for i in idx]
            )
            for i, out in zip(idx, batch, strict=True):
                outputs[i] = out
        return outputs

    @torch.inference_mode()
    def _generate_batch(self, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        from transformers import GenerationConfig

        max_prompt_len = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), max_prompt_len), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):
            input_ids[row, max_prompt_len - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, max_prompt_len - len(prompt) :] = 1
        gen_config = GenerationConfig(
            max_new_tokens=max(output_lens), do_sample=False, pad_token_id=self._pad_id
        )
        seqs = self._model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_config
        )
        new_tokens = seqs[:, max_prompt_len:]
        return [new_tokens[row, :n].tolist() for row, n in enumerate(output_lens)]

    def close(self) -> None:
        del self._model


class HFContinuousRunner:
    """transformers' continuous batching (paged KV cache, scheduler thread), greedy."""

    def __init__(self, cfg: BenchConfig, workloads: Sequence[Workload]) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self._model = load_hf_model(cfg)
        pad_id = self._model.config.pad_token_id
        # eos -1 is the CB manager's own "disabled" value.
        self._gen_config = GenerationConfig(
            do_sample=False, eos_token_id=-1, pad_token_id=0 if pad_id is None else int(pad_id)
        )
        self._num_calls = 0
        # Explicit sizes: left unset on CPU, the cache takes 60% of free RAM with max_batch_tokens
        # 8192, and allocating it costs seconds on every generate_batch call.
        self._cb_config = ContinuousBatchingConfig(
            page_size=cfg.hf_page_size,
            num_blocks=_hf_num_blocks(workloads, cfg.hf_page_size, cfg.max_num_seqs),
            max_batch_tokens=cfg.max_num_batched_tokens,
            max_requests_per_batch=cfg.max_num_seqs,
            use_cuda_graph=False,
            seed=cfg.seed,
        )

    def api(self, workload: Workload) -> str:
        return "generate_batch" if workload.is_uniform else "manager.add_request"

    def generate(self, workload: Workload) -> list[list[int]]:
        self._num_calls += 1
        if workload.is_uniform:
            return self._generate_batch(workload)
        return self._generate_per_request(workload)

    def _generate_batch(self, workload: Workload) -> list[list[int]]:
        # persistent_manager: build the cache and scheduler once, as for the engine's LLM().
        results = self._model.generate_batch(
            workload.prompts,
            generation_config=self._gen_config,
            continuous_batching_config=self._cb_config,
            persistent_manager=True,
            max_new_tokens=workload.output_lens[0],
        )
        outs = list(results.values())
        # generate_batch logs failures instead of raising, so check here.
        if len(outs) != len(workload.prompts) or any(o.error for o in outs):
            errors = {o.error for o in outs if o.error}
            raise RuntimeError(f"generate_batch: {len(outs)}/{len(workload.prompts)} ok {errors}")
        return [list(o.generated_tokens) for o in outs]

    def _generate_per_request(self, workload: Workload) -> list[list[int]]:
        req_ids = [f"c{self._num_calls}-{i}" for i in range(len(workload.prompts))]
        results: dict[str, Any] = {}
        with self._model.continuous_batching_context_manager(
            generation_config=self._gen_config,
            continuous_batching_config=self._cb_config,
            persistent_manager=True,
        ) as manager:
            requests = zip(req_ids, workload.prompts, workload.output_lens, strict=True)
            for req_id, prompt, n in requests:
                manager.add_request(prompt, request_id=req_id, max_new_tokens=n)
            while len(results) < len(req_ids):
                out = manager.get_result(timeout=1.0)
                if out is None and not manager.is_running():
                    raise RuntimeError("CB generation thread died; see its log above")
                if out is not None and out.is_finished():
                    results[out.request_id] = out
        errors = {r.error for r in results.values() if r.error}
        if errors:
            raise RuntimeError(f"CB requests failed: {errors}")
        return [list(results[r].generated_tokens) for r in req_ids]

    def close(self) -> None:
        self._model.destroy_cached_continuous_batching_manager()
        del self._model


def _hf_num_blocks(workloads: Sequence[Workload], page_size: int, max_num_seqs: int) -> int:
    """Enough pages for the `max_num_seqs` longest requests at once, so nothing is ever evicted."""
    lens = [len(p) + n for wl in workloads for p, n in zip(wl.prompts, wl.output_lens, strict=True)]
    pages = sorted((-(-n // page_size) for n in lens), reverse=True)
    return sum(pages[:max_num_seqs]) + max_num_seqs


def make_runner(system: str, cfg: BenchConfig, workloads: Sequence[Workload]) -> Runner:
    """Load one system (untimed)."""
    if system == "asyncengine":
        return AsyncEngineRunner(cfg)
    if system == "hf-static":
        return HFStaticRunner(cfg)
    if system == "hf-cb":
        return HFContinuousRunner(cfg, workloads)
    raise ValueError(f"unknown system {system!r}")


# ----------------------------------------------------------------------------------------------
# Measurement


def measure(
    runner: Runner, system: str, workload: Workload, warmup: Workload, again: Workload | None
) -> Result:
    """Warm up (untimed), then time one full pass and check every request got its tokens;
    then, with `again`, time a second pass over its (fresh) prompts of the same lengths."""
    result = Result(system=system, workload=workload.name, api=runner.api(workload))
    result.num_requests = len(workload.prompts)
    result.num_prompt_tokens = workload.num_prompt_tokens
    # Useful tokens only: what each request asked for, not the padding hf-static also computes.
    result.num_generated_tokens = workload.num_generated_tokens
    runner.generate(warmup)
    torch.manual_seed(0)
    cpu_before = cpu_seconds()
    start = time.perf_counter()
    outputs = runner.generate(workload)
    result.wall_s = time.perf_counter() - start
    cpu_after = cpu_seconds()
    result.other_cores = other_cores(cpu_before, cpu_after, result.wall_s)
    if cpu_before is not None and cpu_after is not None and cpu_after[1] > cpu_before[1]:
        result.gen_tok_per_cpu_s = result.num_generated_tokens / (cpu_after[1] - cpu_before[1])
    got_lens = [len(o) for o in outputs]
    if got_lens != workload.output_lens:
        num_bad = sum(g != w for g, w in zip(got_lens, workload.output_lens, strict=False))
        raise RuntimeError(f"{num_bad} requests got the wrong number of tokens")
    result.outputs = outputs
    result.gen_tok_s = result.num_generated_tokens / result.wall_s
    result.total_tok_s = (result.num_prompt_tokens + result.num_generated_tokens) / result.wall_s
    if again is not None:
        start = time.perf_counter()
        runner.generate(again)
        result.second_pass_tok_s = again.num_generated_tokens / (time.perf_counter() - start)
    return result


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except OSError:
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]  # minus idle and iowait
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return busy / os.sysconf("SC_CLK_TCK"), usage.ru_utime + usage.ru_stime


def other_cores(
    before: tuple[float, float] | None, after: tuple[float, float] | None, wall_s: float
) -> float | None:
    """Cores that other processes kept busy during the timing.

    On a shared box this is what makes numbers move: with threads > 1 every OpenMP barrier waits
    for a thread whose core is taken, and small matmuls get many times slower.
    """
    if before is None or after is None or wall_s <= 0:
        return None
    foreign = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, foreign / wall_s)


def run_dtype(
    cfg: BenchConfig,
    workloads: dict[str, Workload],
    systems: Sequence[str],
    names: Sequence[str],
    rounds: int,
    passes: int = 2,
) -> list[Result]:
    """Load every system in `cfg.dtype` once, then measure each on each named workload, `rounds`
    times, alternating the systems' order; errors become result rows."""
    runners: dict[str, Runner] = {}
    results: list[Result] = []
    for system in systems:
        print(f"loading {system} ({cfg.dtype}) ...", file=sys.stderr, flush=True)
        try:
            runners[system] = make_runner(system, cfg, [workloads[n] for n in names])
        except Exception as exc:  # the engine may not import yet; report it and go on
            results += [Result(system, n, cfg.dtype, error=_describe(exc)) for n in names]
    for round_index in range(rounds):
        order = list(runners) if round_index % 2 == 0 else list(reversed(runners))
        for name in names:
            for system in order:
                try:
                    again = workloads[f"again-{name}"] if passes > 1 else None
                    result = measure(
                        runners[system],
                        system,
                        workloads[name],
                        workloads[f"warmup-{name}"],
                        again,
                    )
                except Exception as exc:
                    result = Result(system, name, error=_describe(exc))
                result.dtype, result.round = cfg.dtype, round_index
                results.append(result)
                second = result.second_pass_tok_s
                print(
                    f"  {cfg.dtype} round {round_index}: {system} on {name} "
                    f"{result.gen_tok_s:.1f} tok/s"
                    + ("" if second is None else f" (second pass {second:.1f})"),
                    file=sys.stderr,
                    flush=True,
                )
    for runner in runners.values():
        runner.close()
    gc.collect()
    return results


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def compare(results: list[Result]) -> None:
    """Fill speedups and output agreement against asyncengine (else the first system that ran),
    within each (dtype, workload, round)."""
    for key in dict.fromkeys((r.dtype, r.workload, r.round) for r in results):
        rows = [r for r in results if (r.dtype, r.workload, r.round) == key and r.error is None]
        engine = next((r for r in rows if r.system == "asyncengine"), None)
        ref = engine or (rows[0] if rows else None)
        for row in rows:
            if engine is not None:
                row.speedup_of_asyncengine = engine.gen_tok_s / row.gen_tok_s
                if engine.gen_tok_per_cpu_s and row.gen_tok_per_cpu_s:
                    row.cpu_speedup_of_asyncengine = (
                        engine.gen_tok_per_cpu_s / row.gen_tok_per_cpu_s
                    )
            if ref is not None and row is not ref and ref.outputs and row.outputs:
                row.match_ref = ref.system
                row.seq_match, row.token_match = match_rates(ref.outputs, row.outputs)


def match_rates(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(share of requests identical to `ref`, share of `ref` tokens inside the common prefix)."""
    num_same = sum(a == b for a, b in zip(ref, got, strict=True))
    prefix = 0
    for a, b in zip(ref, got, strict=True):
        # A greedy run that diverges once never re-aligns, so only the common prefix counts.
        diverged_at = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        prefix += next(diverged_at, min(len(a), len(b)))
    return num_same / len(ref), prefix / max(1, sum(len(a) for a in ref))


# ----------------------------------------------------------------------------------------------
# Report


@dataclass
class Summary:
    """One (dtype, workload, system) over its rounds: medians, and the spread of the ratio."""

    dtype: str
    workload: str
    system: str
    api: str
    num_rounds: int
    num_requests: int
    num_prompt_tokens: int
    num_generated_tokens: int
    gen_tok_s: float  # median over rounds
    first_pass_tok_s: float  # round 0's first pass: the shapes met for the first time
    second_pass_tok_s: float | None  # round 0's second pass: the same shapes again
    speedup_of_asyncengine: float | None  # median of the per-round ratios
    speedup_min: float | None
    speedup_max: float | None
    cpu_speedup: float | None  # median of the per-round ratios of tokens per CPU second
    other_cores_max: float | None
    match_ref: str | None
    seq_match: float | None
    token_match: float | None


def summarize(results: list[Result]) -> list[Summary]:
    """Rows that ran, grouped by (dtype, workload, system) in first-seen order."""
    groups: dict[tuple[str, str, str], list[Result]] = {}
    for r in results:
        if r.error is None:
            groups.setdefault((r.dtype, r.workload, r.system), []).append(r)
    summaries = []
    for (dtype, workload, system), rows in groups.items():
        ratios = [r.speedup_of_asyncengine for r in rows if r.speedup_of_asyncengine is not None]
        others = [r.other_cores for r in rows if r.other_cores is not None]
        cpu_ratios = [
            r.cpu_speedup_of_asyncengine for r in rows if r.cpu_speedup_of_asyncengine is not None
        ]
        first = rows[0]
        summaries.append(
            Summary(
                dtype=dtype,
                workload=workload,
                system=system,
                api=first.api,
                num_rounds=len(rows),
                num_requests=first.num_requests,
                num_prompt_tokens=first.num_prompt_tokens,
                num_generated_tokens=first.num_generated_tokens,
                gen_tok_s=statistics.median(r.gen_tok_s for r in rows),
                first_pass_tok_s=first.gen_tok_s,
                second_pass_tok_s=first.second_pass_tok_s,
                speedup_of_asyncengine=statistics.median(ratios) if ratios else None,
                speedup_min=min(ratios) if ratios else None,
                speedup_max=max(ratios) if ratios else None,
                cpu_speedup=statistics.median(cpu_ratios) if cpu_ratios else None,
                other_cores_max=max(others) if others else None,
                match_ref=first.match_ref,
                seq_match=first.seq_match,
                token_match=first.token_match,
            )
        )
    return summaries


def format_table(results: list[Result], default_dtype: str = "") -> str:
    """A fixed-width table of medians over rounds; `ae/x` is asyncengine's generated tok/s over
    this row's (median of the rounds' ratios, and their range), `other` the most cores other
    processes used during one of the row's timings, `cpu ae/x` the ratio of tokens per CPU
    second of the process; `*` marks the engine's default dtype; `1st`/`2nd` are round 0's two
    passes (the second meets the first's batch shapes again) and `1st/2nd` their ratio."""
    head = (
        f"{'dtype':<10} {'workload':<8} {'system':<12} {'api':<22} {'runs':>4} {'reqs':>5} "
        f"{'gen':>6} {'gen tok/s':>9} {'ae/x':>5} {'ae/x range':>11} {'cpu ae/x':>8} "
        f"{'other':>5} {'1st':>6} {'2nd':>6} {'1st/2nd':>7}  match vs ref"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        if r.error is not None:
            lines.append(f"{r.dtype:<10} {r.workload:<8} {r.system:<12} ERROR {r.error}")
    for row in summarize(results):
        dtype = row.dtype + ("*" if row.dtype == default_dtype else "")
        ratio = "-" if row.speedup_of_asyncengine is None else f"{row.speedup_of_asyncengine:.2f}"
        spread = (
            "-"
            if row.speedup_min is None or row.system == "asyncengine"
            else f"{row.speedup_min:.2f}-{row.speedup_max:.2f}"
        )
        other = "?" if row.other_cores_max is None else f"{row.other_cores_max:.2f}"
        cpu_ratio = "-" if row.cpu_speedup is None else f"{row.cpu_speedup:.2f}"
        match = (
            "(ref)"
            if row.match_ref is None
            else f"{row.seq_match:.0%} reqs, {row.token_match:.1%} tok vs {row.match_ref}"
        )
        second = row.second_pass_tok_s
        passes = f"{row.first_pass_tok_s:>6.1f} " + (
            f"{'-':>6} {'-':>7}"
            if second is None
            else f"{second:>6.1f} {row.first_pass_tok_s / second:>7.2f}"
        )
        lines.append(
            f"{dtype:<10} {row.workload:<8} {row.system:<12} {row.api:<22} {row.num_rounds:>4} "
            f"{row.num_requests:>5} {row.num_generated_tokens:>6} {row.gen_tok_s:>9.1f} "
            f"{ratio:>5} {spread:>11} {cpu_ratio:>8} {other:>5} {passes}  {match}"
        )
    return "\n".join(lines)


def notes(cfg: BenchConfig, results: list[Result], default_dtype: str) -> list[str]:
    """Caveats printed under the table and stored in the JSON."""
    busiest = max((r.other_cores or 0.0 for r in results), default=0.0)
    shared = []
    if busiest > 0.2:
        shared = [
            f"WARNING: other processes kept up to {busiest:.2f} cores busy during a timing; "
            "rows with a high `other` are not comparable (rerun on an idle box, or --threads 1)."
        ]
    return [
        *shared,
        "gen tokens = tokens requested (ignore_eos); hf-static also computes padding and the tail "
        "of each batch up to its longest request, which is not counted.",
        f"hf-static: batches of {cfg.batch_size} in {cfg.hf_order} order, left padding, SDPA.",
        "hf-cb on CPU: no flash attention, so each step gathers the batch's whole KV into one "
        "packed sequence and runs SDPA with a dense [query tokens x all batch KV tokens] mask; "
        "attention work grows with (batch size)^2. generate_batch also stops its thread per "
        "call (~0.1 s, inside the timing).",
        f"hf-cb sizes: max_batch_tokens={cfg.max_num_batched_tokens}, "
        f"max_requests_per_batch={cfg.max_num_seqs}, page_size={cfg.hf_page_size}, cache sized so "
        "no request is evicted.",
        "match: greedy outputs compared token for token; bf16 runs may diverge legitimately.",
        f"engine default dtype on this machine (dtype='auto'): {default_dtype}; HF runs in the "
        "same dtype as the engine on every row.",
    ]


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Flags; `--quick` swaps in QUICK_DEFAULTS before parsing so explicit flags still win."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="HF model directory")
    src.add_argument(
        "--make-model",
        choices=sorted([*MODEL_PRESETS, *SIZED_PRESETS]),
        help="random Llama (tiny); 60m: make_sized_llama(768, 8)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help=f"comma list from {','.join([*DTYPES, AUTO])} (auto: the engine's default)",
    )
    p.add_argument("--rounds", type=int, default=1, help="timings per (dtype, workload, system)")
    p.add_argument(
        "--passes", type=int, choices=(1, 2), default=2, help="2: also time a second pass"
    )
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="subset of mixed,uniform")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--uniform-output", type=int, default=0, help="default: mid of output range")
    p.add_argument("--batch-size", type=int, default=16, help="hf-static batch size")
    p.add_argument("--hf-order", choices=("arrival", "sorted"), default="arrival")
    p.add_argument("--max-num-seqs", type=int, default=128, help="asyncengine and hf-cb")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="asyncengine, hf-cb")
    p.add_argument("--hf-page-size", type=int, default=256, help="hf-cb page size (HF default)")
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sanity config, < 1 min")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--json-out", type=Path, help="also write the JSON report to this file")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--quick" in argv:
        p.set_defaults(**QUICK_DEFAULTS)
    args = p.parse_args(argv)
    for flag in ("systems", "workloads"):
        chosen = [s.strip() for s in getattr(args, flag).split(",") if s.strip()]
        allowed = SYSTEMS if flag == "systems" else WORKLOADS
        if not chosen or any(s not in allowed for s in chosen):
            p.error(f"--{flag} must be a comma list from {','.join(allowed)}")
        setattr(args, flag, chosen)
    args.dtype = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if not args.dtype or any(d not in (*DTYPES, AUTO) for d in args.dtype):
        p.error(f"--dtype must be a comma list from {','.join([*DTYPES, AUTO])}")
    if args.min_prompt > args.max_prompt or args.min_output > args.max_output:
        p.error("min lengths must not exceed max lengths")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def engine_default_dtype(model_dir: Path) -> str:
    """What dtype="auto" resolves to for this model on this machine's CPU."""
    from asyncengine import EngineArgs

    args = EngineArgs(model=str(model_dir), device="cpu")
    return args.create_engine_config().model_config.dtype


def prompt_token_ids(model_dir: Path) -> tuple[list[int], int]:
    """Vocab ids minus the special ones, and the model's position limit."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    special = {
        getattr(config, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")
    }
    flat = {i for s in special for i in (s if isinstance(s, list) else [s]) if i is not None}
    return [i for i in range(config.vocab_size) if i not in flat], config.max_position_embeddings


def quiet_hf() -> None:
    """HF logs a lot per call (deprecations, CB manager info); keep the report readable."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    cb_logger.setLevel(logging.WARNING)
    # Reusing the manager is deliberate here (same sizes every call); drop that one warning.
    cb_logger.addFilter(lambda record: "persistent_manager=True" not in record.getMessage())
    warnings.filterwarnings("ignore", category=FutureWarning)


def benchmark(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """Run every chosen system on every chosen workload; return the JSON-able report."""
    token_ids, max_positions = prompt_token_ids(model_dir)
    if args.max_prompt + max(args.max_output, args.uniform_output) > max_positions:
        raise SystemExit(f"prompt + output exceeds max_position_embeddings={max_positions}")
    default_dtype = engine_default_dtype(model_dir)
    dtypes = list(dict.fromkeys(default_dtype if d == AUTO else d for d in args.dtype))
    if any(d not in DTYPES for d in dtypes):
        raise SystemExit(f"the engine's default dtype {default_dtype} is not benchmarked here")
    longest = args.max_prompt + max(args.max_output, args.uniform_output)
    cfg = BenchConfig(
        model_dir=model_dir,
        dtype=dtypes[0],
        threads=torch.get_num_threads(),
        max_model_len=min(max_positions, 1 << (longest - 1).bit_length()),
        batch_size=args.batch_size,
        hf_order=args.hf_order,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        hf_page_size=args.hf_page_size,
        seed=args.seed,
    )
    workloads = make_workloads(args, token_ids)
    results: list[Result] = []
    for dtype in dtypes:
        results += run_dtype(
            replace(cfg, dtype=dtype),
            workloads,
            args.systems,
            args.workloads,
            args.rounds,
            args.passes,
        )
    compare(results)
    # Group the table by dtype, then workload, systems in the order given.
    results.sort(key=lambda r: (dtypes.index(r.dtype), args.workloads.index(r.workload), r.round))
    run_config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    run_config.update(dtype=dtypes, default_dtype=default_dtype, rounds=args.rounds)
    run_config.update(make_model=args.make_model, quick=args.quick, argv=sys.argv[1:])
    run_config.update(torch=torch.__version__, transformers=_transformers_version())
    # NaN (the timings of a failed row) is not JSON; write null.
    rows = [
        {k: None if _is_nan(v) else v for k, v in asdict(r).items() if k != "outputs"}
        for r in results
    ]
    summary = [
        {k: None if _is_nan(v) else v for k, v in asdict(row).items()} for row in summarize(results)
    ]
    report = {
        "config": run_config,
        "summary": summary,
        "results": rows,
        "notes": notes(cfg, results, default_dtype),
    }
    return {**report, "_results": results}


def _is_nan(value: object) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_hf()
    with tempfile.TemporaryDirectory(prefix="throughput-model-") as tmp:
        model_dir = args.model
        if model_dir is None:
            from asyncengine.testing import make_random_model, make_sized_llama

            preset = args.make_model or "tiny"
            if preset in SIZED_PRESETS:
                model_dir = make_sized_llama(Path(tmp) / preset, *SIZED_PRESETS[preset])
            else:
                model_dir = make_random_model(Path(tmp) / preset, "llama", **MODEL_PRESETS[preset])
        report = benchmark(args, model_dir)
    results: list[Result] = report.pop("_results")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
        return
    cfg = report["config"]
    print(
        f"model={args.model or args.make_model or 'tiny'} dtypes={','.join(cfg['dtype'])} "
        f"rounds={cfg['rounds']} threads={cfg['threads']} torch={cfg['torch']} "
        f"transformers={cfg['transformers']}"
    )
    print(format_table(results, cfg["default_dtype"]))
    print("\n".join(f"* {n}" for n in report["notes"]))


if __name__ == "__main__":
    main()
