"""Train the bundled default model: a small Llama on the docstrings of Python's standard library.

    python scripts/train_default_model.py --minutes 27    # choose the step count from the speed
    python scripts/train_default_model.py --steps 2606    # the bundled model, exactly

Everything comes from the machine itself, so nothing is downloaded: the text is every docstring
in the standard library's source (read with `ast`, nothing imported) plus the reference-manual
topics that `pydoc` ships, a byte-level BPE tokenizer is trained on it, then a Llama-architecture
model (tied embeddings, grouped-query attention). A deterministic 3% of the source files (by a
CRC32 of their path) are held out for validation. The result is written in Hugging Face format
(config.json, model.safetensors in half precision, tokenizer files) together with MODEL_CARD.md,
which records the data, the numbers of the run and samples. Training checkpoints go to
`--work-dir`; `--resume` continues from the last one.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import platform
import shlex
import shutil
import sysconfig
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from asyncengine.testing import train_bpe_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "asyncengine" / "default_model"
HELD_OUT_PERCENT = 3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SAMPLE_PROMPTS = [
    "Return the",
    "This module provides",
    "Explain AI simply",
    "The following methods can be defined to",
    "If the file does not exist,",
]


# -- data ----------------------------------------------------------------------------------------


@dataclass
class Document:
    """One docstring or manual topic; `unit` decides the train/held-out split."""

    unit: str  # source file relative to the stdlib, or "pydoc_data/topics.py::<topic>"
    text: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(unit: str) -> bool:
    """A stable 3% of units (CRC32, not `hash`, which changes between processes)."""
    return zlib.crc32(unit.encode()) % 100 < HELD_OUT_PERCENT


def iter_documents(
    root: Path | None = None, keep: Callable[[str], bool] = lambda unit: True
) -> Iterator[Document]:
    """Every docstring of the stdlib's .py files (sorted, no imports), then the pydoc topics.

    Only units for which `keep(unit)` is true are read (`keep=is_held_out`: the held-out set).
    """
    root = root or stdlib_dir()
    for path in sorted(root.rglob("*.py")):
        unit = path.relative_to(root).as_posix()
        if unit.startswith(("site-packages/", "dist-packages/")) or unit == "pydoc_data/topics.py":
            continue
        if not keep(unit):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):  # a few test files are deliberately invalid
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)  # cleaned: common indentation removed
                if text and text.strip():
                    yield Document(unit, text.strip())
    topics = _pydoc_topics(root / "pydoc_data" / "topics.py")
    yield from (doc for doc in topics if keep(doc.unit))


def _pydoc_topics(path: Path) -> Iterator[Document]:
    if not path.exists():
        return
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and isinstance(value, ast.Constant):
                    yield Document(f"pydoc_data/topics.py::{key.value}", str(value.value).strip())


def split_documents(docs: list[Document]) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts), each text once; held-out texts also in train are dropped."""
    train = list(dict.fromkeys(d.text for d in docs if not is_held_out(d.unit)))
    seen = set(train)
    held_out = list(
        dict.fromkeys(d.text for d in docs if is_held_out(d.unit) and d.text not in seen)
    )
    return train, held_out


def encode_stream(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    """All texts as one int64 stream, each `<s> text </s>` (the tokenizer adds the bos)."""
    ids: list[int] = []
    for encoding in tokenizer(texts).input_ids:
        ids.extend(encoding)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


# -- model and training ----------------------------------------------------------------------------


@dataclass
class RunStats:
    """What MODEL_CARD.md reports; also saved as run_stats.json in the work dir."""

    args: dict[str, Any]
    command: str = ""  # unused; kept so run_stats.json of earlier runs still loads
    versions: dict[str, str] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    num_params: int = 0
    total_steps: int = 0
    train_seconds: float = 0.0
    log: list[dict[str, float]] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[tuple[str, str]]] = field(default_factory=dict)


def make_config(args: argparse.Namespace, tokenizer: Any) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.context_len,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
    )


def lr_at(step: int, total_steps: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    # no weight decay on norms (1-d); the tied embedding is a matrix and is decayed
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def random_windows(stream: torch.Tensor, n: int, ctx: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - ctx, (n,), generator=gen)
    return torch.stack([stream[s : s + ctx] for s in starts.tolist()])


def fixed_windows(stream: torch.Tensor, ctx: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows from the start of `stream` (the tail that does not fit is cut)."""
    num = len(stream) // ctx if max_windows is None else min(max_windows, len(stream) // ctx)
    return stream[: num * ctx].view(num, ctx)


@torch.no_grad()
def mean_loss(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over all predicted positions of `windows`."""
    model.eval()
    total, count = 0.0, 0
    for batch in windows.split(batch_size):
        logits = model(input_ids=batch).logits[:, :-1].float()
        targets = batch[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        )
        total += float(loss)
        count += targets.numel()
    model.train()
    return total / count


class Trainer:
    """AdamW with cosine LR and gradient clipping; periodic logs, evals and checkpoints.

    The forward runs under bfloat16 autocast when `--amp` (about 1.6x faster on CPUs with
    AMX/AVX-512 bf16); weights and optimizer state stay float32.
    """

    def __init__(self, model: LlamaForCausalLM, args: argparse.Namespace, stats: RunStats):
        self.model, self.args, self.stats = model, args, stats
        self.optimizer = make_optimizer(model, args)
        self.gen = torch.Generator().manual_seed(args.seed)
        self.checkpoint_path = Path(args.work_dir) / "checkpoint.pt"
        self.step, self.elapsed = 0, 0.0
        self.total_steps = args.steps or 0  # 0: calibrate from the speed of the first steps

    def run(self, train_stream: torch.Tensor, val_windows: torch.Tensor) -> None:
        args = self.args
        if args.resume and self.checkpoint_path.exists():
            self._load_checkpoint()
        self.model.train()
        recent: list[float] = []
        while self.total_steps == 0 or self.step < self.total_steps:
            start = time.perf_counter()
            lr = lr_at(self.step, max(self.total_steps, args.warmup_steps + 1), args)
            recent.append(self._train_step(train_stream, lr))
            self.step += 1
            self.elapsed += time.perf_counter() - start
            if self.total_steps == 0 and self.step == args.calibration_steps:
                # the warmup covers calibration, so the schedule is that of `--steps total_steps`
                seconds_per_step = self.elapsed / self.step
                self.total_steps = max(self.step + 1, int(args.minutes * 60 / seconds_per_step))
                print(f"{seconds_per_step:.2f} s/step: {self.total_steps} steps", flush=True)
            is_last = self.step == self.total_steps
            if self.step % args.log_every == 0 or is_last:
                self._log(lr, recent, val_windows, is_eval=self.step % args.eval_every == 0)
                recent.clear()
            if self.step % args.checkpoint_every == 0 or is_last:
                self._save_checkpoint()
        self.stats.total_steps, self.stats.train_seconds = self.total_steps, self.elapsed

    def _train_step(self, train_stream: torch.Tensor, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = random_windows(train_stream, self.args.batch_size, self.args.context_len, self.gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.args.amp):
            loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def _log(self, lr: float, recent: list[float], val_windows: torch.Tensor, is_eval: bool):
        entry = {"step": self.step, "minutes": self.elapsed / 60, "lr": lr}
        entry["train_loss"] = sum(recent) / len(recent)
        if is_eval or self.step == self.total_steps:
            entry["val_loss"] = mean_loss(self.model, val_windows[: self.args.eval_windows])
        self.stats.log.append(entry)
        print(" ".join(f"{k} {v:.4g}" for k, v in entry.items()), flush=True)

    def _save_checkpoint(self) -> None:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.gen.get_state(),
            "step": self.step,
            "elapsed": self.elapsed,
            "total_steps": self.total_steps,
            "log": self.stats.log,
        }
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.checkpoint_path)  # a run killed mid-save keeps the previous checkpoint

    def _load_checkpoint(self) -> None:
        state = torch.load(self.checkpoint_path, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.gen.set_state(state["generator"])
        self.step, self.elapsed = state["step"], state["elapsed"]
        self.total_steps, self.stats.log = state["total_steps"], state["log"]
        print(f"resumed at step {self.step} ({self.elapsed / 60:.1f} min)", flush=True)


# -- export, evaluation and the model card ---------------------------------------------------------


def export(model: LlamaForCausalLM, tokenizer_dir: Path, out_dir: Path, dtype: str) -> None:
    """Write config, half-precision safetensors and tokenizer files; other files are kept."""
    out_dir.mkdir(parents=True, exist_ok=True)
    half = LlamaForCausalLM(model.config)
    half.load_state_dict(model.state_dict())
    half.to(getattr(torch, dtype))
    half.config.dtype = dtype
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(half.generation_config, name, getattr(model.config, name))
    half.save_pretrained(str(out_dir), safe_serialization=True)
    (out_dir / "model.safetensors").chmod(0o644)  # written 0600; a package ships it world-readable
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)


def spread_windows(stream: torch.Tensor, ctx: int, num: int) -> torch.Tensor:
    """`num` windows at evenly spaced offsets, so that a few cover the whole stream."""
    starts = torch.linspace(0, len(stream) - ctx, num).long().tolist()
    return torch.stack([stream[s : s + ctx] for s in starts])


def make_samples(model_dir: Path, seed: int) -> dict[str, list[tuple[str, str]]]:
    """Greedy and sampled continuations of SAMPLE_PROMPTS, from the saved files."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples: dict[str, list[tuple[str, str]]] = {"greedy": [], "sampled": []}
    torch.manual_seed(seed)
    for kind, options in (
        ("greedy", {"do_sample": False}),
        ("sampled", {"do_sample": True, "temperature": 0.8, "top_k": 50}),
    ):
        for prompt in SAMPLE_PROMPTS:
            input_ids = tokenizer(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(input_ids, max_new_tokens=48, **options)
            text = tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)
            samples[kind].append((prompt, text))
    return samples


def write_model_card(out_dir: Path, stats: RunStats) -> None:
    """MODEL_CARD.md from the numbers of this run."""
    a, d, f = stats.args, stats.data, stats.final
    num_tokens = stats.total_steps * a["batch_size"] * a["context_len"]
    log_rows = "\n".join(
        f"| {e['step']:.0f} | {e['minutes']:.1f} | {e['lr']:.2e} | {e['train_loss']:.3f} "
        f"| {e['val_loss']:.3f} |"
        for e in stats.log
        if "val_loss" in e
    )
    results = [
        (f"train ({f['num_train_windows']:.0f} windows spread over it)", f["train_loss"]),
        (f"held-out (all {f['num_val_windows']:.0f} windows)", f["val_loss"]),
        (f"held-out, as shipped ({a['save_dtype']} weights)", f["val_loss_saved"]),
        ("uniform over the vocabulary", math.log(d["vocab_size"])),
    ]
    result_rows = "\n".join(
        f"| {name} | {loss:.3f} | {math.exp(loss):.1f} |" for name, loss in results
    )
    samples = "\n\n".join(
        f"{kind}:\n\n"
        + "\n".join(f"- `{p}` → {json.dumps(t, ensure_ascii=False)}" for p, t in pairs)
        for kind, pairs in stats.samples.items()
    )
    versions = ", ".join(f"{k} {v}" for k, v in stats.versions.items() if k != "python")
    calibration = ""
    if a["minutes"] is not None:
        calibration = (
            f"The run itself was `--minutes {a['minutes']:g}`: it timed its first "
            f"{a['calibration_steps']} steps and chose {stats.total_steps} steps to fit.\n\n"
        )
    text = f"""# asyncengine default model

A {stats.num_params / 1e6:.2f}M-parameter Llama trained from scratch on the docstrings of Python's
standard library, so that `LLM()` and `EngineArgs()` give readable text on an offline machine.
It writes English in the style of Python documentation; it knows little else and is not an
assistant. Made by `scripts/train_default_model.py`, which also wrote this card.

## Reproduce

```bash
{reproduce_command(a, stats.total_steps)}
```

{calibration}Deterministic for the same standard library (Python {stats.versions["python"]}),
the same library versions ({versions}) and CPU, with one torch thread.

## Data

- Every docstring (`ast.get_docstring`; nothing is imported) of the `.py` files under
  `{d["stdlib"]}`, tests included, `site-packages` excluded, plus the reference-manual
  topics in `pydoc_data/topics.py`: {d["num_documents"]:,} texts from {d["num_units"]:,} files
  and topics. Exact duplicates are kept once.
- Held out: the files and topics whose `zlib.crc32(path) % 100 < {HELD_OUT_PERCENT}`, less any
  text that also occurs in the training files.
- Train: {d["train_docs"]:,} texts, {d["train_chars"]:,} characters, {d["train_tokens"]:,} tokens.
- Held-out: {d["val_docs"]:,} texts, {d["val_chars"]:,} characters, {d["val_tokens"]:,} tokens.
- Each text is encoded as `<s> text </s>` and the texts are concatenated into one stream;
  training windows of {a["context_len"]} tokens start at random offsets.

## Tokenizer

Byte-level BPE (`asyncengine.testing.train_bpe_tokenizer`: GPT-2 pre-tokenizer, no prefix
space) trained on the training texts only: {d["vocab_size"]} tokens, of which `<s>` (0),
`</s>` (1), `<pad>` (2), the 256 bytes and merges. Any text (Korean, emoji) round-trips;
`<s>` is added on encode. {d["chars_per_token"]:.2f} characters per token on the training text.

## Architecture

`LlamaForCausalLM`: vocab {d["vocab_size"]}, hidden {a["hidden_size"]}, {a["layers"]} layers,
{a["heads"]} query heads over {a["kv_heads"]} KV heads (head dim {a["hidden_size"] // a["heads"]}),
SwiGLU MLP {a["intermediate_size"]}, RMSNorm (eps 1e-5), RoPE (theta 10000),
max_position_embeddings {a["context_len"]} (the training context), tied input and output
embeddings: **{stats.num_params:,} parameters**, stored in {a["save_dtype"]}
({d["file_mb"]:.1f} MB).

## Training

AdamW (betas 0.9/0.95, weight decay {a["weight_decay"]} on matrices), peak LR {a["lr"]},
linear warmup over {a["warmup_steps"]} steps then cosine decay to 10%, gradient clipping 1.0,
batches of {a["batch_size"]} × {a["context_len"]} tokens, **{stats.total_steps} steps**
({num_tokens:,} tokens, {num_tokens / d["train_tokens"]:.1f} epochs). Float32 weights,
{"bfloat16 autocast" if a["amp"] else "float32"} forward, on {a["threads"]} CPU thread(s) of a
shared machine: **{stats.train_seconds / 60:.1f} minutes** of training steps.

| step | minutes | lr | train loss (recent batches) | held-out loss ({a["eval_windows"]} windows) |
|---:|---:|---:|---:|---:|
{log_rows}

## Results

Mean next-token cross-entropy (nats) over windows of {a["context_len"]} tokens, float32 compute:

| text | loss | perplexity |
|---|---:|---:|
{result_rows}

## Limits

It continues text the way a docstring would: short English sentences about arguments, return
values, files and classes, often ending with `</s>` after a sentence or two. It has no knowledge
beyond that, follows no instructions, and answers a Korean prompt in docstring English (its
tokenizer still encodes Korean, byte by byte). Its context is {a["context_len"]} tokens, which is
also the engine's default `max_model_len` for it. It exists so that a fresh install shows
readable output; load a real model for anything else.

## Samples

From the shipped files through `transformers`, 48 new tokens; sampled with temperature 0.8 and
top-k 50 (seed {a["seed"]}).

{samples}
"""
    (out_dir / "MODEL_CARD.md").write_text(text)


# -- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out-dir", default=str(DEFAULT_OUT_DIR), help="where the model files go")
    p.add_argument("--work-dir", default="/tmp/asyncengine-default-model", help="checkpoints")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps (fixes the LR schedule)")
    length.add_argument("--minutes", type=float, default=27.0, help="training time budget")
    p.add_argument("--calibration-steps", type=int, default=20, help="steps timed for --minutes")
    p.add_argument("--resume", action="store_true", help="continue from the work dir checkpoint")
    p.add_argument(
        "--write-card", action="store_true", help="only rewrite the card from the last run's stats"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is kind to a shared box)"
    )
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=704)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument(
        "--amp", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast"
    )
    p.add_argument("--save-dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = p.parse_args(argv)
    if args.steps is not None:
        args.minutes = None
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work_dir, out_dir = Path(args.work_dir), Path(args.out_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    if args.write_card:
        write_model_card(out_dir, RunStats(**json.loads((work_dir / "run_stats.json").read_text())))
        return
    stats = RunStats(args=vars(args).copy())
    stats.versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }

    docs = list(iter_documents())
    train_texts, val_texts = split_documents(docs)
    print(
        f"{len(docs)} docstrings: {len(train_texts)} train, {len(val_texts)} held out", flush=True
    )
    tokenizer_dir = work_dir / "tokenizer"
    train_bpe_tokenizer(tokenizer_dir, vocab_size=args.vocab_size, corpus=train_texts)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    train_stream = encode_stream(tokenizer, train_texts)
    val_stream = encode_stream(tokenizer, val_texts)
    val_windows = fixed_windows(val_stream, args.context_len)
    stats.data = {
        "stdlib": str(stdlib_dir()),
        "num_documents": len(docs),
        "num_units": len({d.unit for d in docs}),
        "train_docs": len(train_texts),
        "train_chars": sum(map(len, train_texts)),
        "train_tokens": len(train_stream),
        "val_docs": len(val_texts),
        "val_chars": sum(map(len, val_texts)),
        "val_tokens": len(val_stream),
        "vocab_size": len(tokenizer),
    }
    stats.data["chars_per_token"] = stats.data["train_chars"] / len(train_stream)
    print(json.dumps(stats.data), flush=True)

    model = LlamaForCausalLM(make_config(args, tokenizer))
    stats.num_params = sum(p.numel() for p in model.parameters())
    print(f"{stats.num_params:,} parameters", flush=True)
    Trainer(model, args, stats).run(train_stream, val_windows)

    export(model, tokenizer_dir, out_dir, args.save_dtype)
    saved = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    train_windows = spread_windows(train_stream, args.context_len, 32)
    stats.final = {
        "train_loss": mean_loss(model, train_windows),
        "val_loss": mean_loss(model, val_windows),
        "val_loss_saved": mean_loss(saved, val_windows),
        "num_train_windows": len(train_windows),
        "num_val_windows": len(val_windows),
    }
    stats.data["file_mb"] = (out_dir / "model.safetensors").stat().st_size / 1e6
    print(json.dumps(stats.final), flush=True)
    stats.samples = make_samples(out_dir, args.seed)
    write_model_card(out_dir, stats)
    (work_dir / "run_stats.json").write_text(json.dumps(asdict(stats), indent=2) + "\n")
    print(f"wrote {out_dir}", flush=True)


def reproduce_command(args: dict[str, Any], total_steps: int) -> str:
    """The command that trains the same weights: non-default options and the steps that ran."""
    defaults = vars(parse_args([]))
    # options that change no weight (where files go, how often to log, evaluate or save)
    ignored = {"out_dir", "work_dir", "resume", "write_card", "log_every", "eval_every"}
    ignored |= {"eval_windows", "checkpoint_every", "calibration_steps", "steps", "minutes"}
    argv = []
    for name, value in args.items():
        if name in ignored or value == defaults.get(name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    argv += ["--steps", str(total_steps)]
    return "python scripts/train_default_model.py " + shlex.join(argv)


if __name__ == "__main__":
    main()
