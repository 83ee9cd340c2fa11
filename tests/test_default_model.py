"""The bundled default model: the default of `EngineArgs()`/`LLM()`, small, loadable by
transformers, greedy-identical in the engine, and trained (held-out perplexity far below uniform).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncengine import LLM, EngineArgs, RequestOutput, SamplingParams, default_model
from asyncengine.config import cpu_bf16_flag
from asyncengine.testing import HF_PROMPTS

if TYPE_CHECKING:
    from conftest import HFGreedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL_DIR = Path(default_model.path())
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_default_model.py"
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
DOCSTRING_PROMPTS = [
    "Return the",
    "This module provides",
    "Explain AI simply",
    "If the file does not exist,",
    "The following methods can be defined to customize",
]


def load_training_script() -> ModuleType:
    """scripts/train_default_model.py as a module, for its corpus and held-out split."""
    spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def greedy_outputs(tokenizer: Any) -> tuple[list[list[int]], list[RequestOutput]]:
    """(prompt token ids, engine outputs) for docstring prompts and the HF_PROMPTS that fit."""
    context_len = json.loads((MODEL_DIR / "config.json").read_text())["max_position_embeddings"]
    encoded = [tokenizer(p).input_ids for p in DOCSTRING_PROMPTS + HF_PROMPTS]
    prompts = [ids for ids in encoded if len(ids) + MAX_TOKENS <= context_len]
    assert len(prompts) >= 12
    # no model argument: the bundled default
    llm = LLM(device="cpu", dtype="float32", max_num_seqs=16)  # caps the KV cache it allocates
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return prompts, outs


def test_engine_args_default_to_the_bundled_model() -> None:
    assert EngineArgs().model == default_model.path() == str(MODEL_DIR)
    config = EngineArgs(device="cpu").create_engine_config()
    assert config.model_config.architecture == "LlamaForCausalLM"
    assert (
        config.model_config.max_model_len == config.model_config.hf_config.max_position_embeddings
    )
    # auto on the CPU: bf16 where the CPU multiplies it natively
    assert config.model_config.dtype == ("bfloat16" if cpu_bf16_flag() else "float32")


def test_bundled_files_are_a_small_half_precision_llama() -> None:
    for name in ("config.json", "generation_config.json", "tokenizer.json", "MODEL_CARD.md"):
        assert (MODEL_DIR / name).is_file(), name
    weights = MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size < 16 * 2**20
    with safe_open(str(weights), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert {t.dtype for t in tensors.values()} <= {torch.bfloat16, torch.float16}
    assert "lm_head.weight" not in tensors  # tied to the input embedding
    num_params = sum(t.numel() for t in tensors.values())
    assert 3_000_000 <= num_params <= 20_000_000
    card = (MODEL_DIR / "MODEL_CARD.md").read_text()
    assert f"{num_params:,} parameters" in card
    assert "python scripts/train_default_model.py" in card


def test_tokenizer_round_trips_any_text(tokenizer: Any) -> None:
    texts = [*HF_PROMPTS, "🦄 漢字 ∑ ünïcödé 🇯🇵", "def f(x):\n\treturn x  # \x00 tab"]
    for text in texts:
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_greedy_parity_with_hf(
    greedy_outputs: tuple[list[list[int]], list[RequestOutput]], hf_greedy: HFGreedy
) -> None:
    prompts, outs = greedy_outputs
    problems = []
    for i, (prompt_token_ids, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.error is None and out.prompt_token_ids == prompt_token_ids
        got = out.outputs[0].token_ids
        expected = hf_greedy(MODEL_DIR, prompt_token_ids, MAX_TOKENS)
        if got != expected:
            pos = next(k for k, (a, b) in enumerate(zip(got, expected)) if a != b)
            margin = hf_greedy.margin(MODEL_DIR, prompt_token_ids, pos)
            problems.append(f"prompt {i}: first difference at {pos} (HF margin {margin:.2e})")
    assert not problems, "\n".join(problems)


def test_greedy_text_reads_like_english(
    greedy_outputs: tuple[list[list[int]], list[RequestOutput]],
) -> None:
    texts = [out.outputs[0].text for out in greedy_outputs[1][: len(DOCSTRING_PROMPTS)]]
    print("\n".join(f"{p!r} -> {t!r}" for p, t in zip(DOCSTRING_PROMPTS, texts)))
    words = re.findall(r"[A-Za-z]+", " ".join(texts))
    assert len(words) >= 10 * len(texts), texts
    common = {"the", "a", "of", "to", "is", "and", "in", "if", "be", "or", "for", "an", "are"}
    assert sum(w.lower() in common for w in words) >= 0.1 * len(words), texts


def test_held_out_perplexity_is_far_below_uniform(tokenizer: Any) -> None:
    script = load_training_script()
    # the held-out files of the training run, read from this interpreter's standard library
    texts = list(dict.fromkeys(doc.text for doc in script.iter_documents(keep=script.is_held_out)))
    context_len = 256
    windows = script.fixed_windows(script.encode_stream(tokenizer, texts), context_len, 24)
    assert len(windows) == 24
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    perplexity = math.exp(script.mean_loss(model, windows))
    vocab_size = model.config.vocab_size  # a uniform model's perplexity
    print(f"held-out perplexity {perplexity:.1f} (bundled) vs {vocab_size} (uniform)")
    assert perplexity < vocab_size / 10
