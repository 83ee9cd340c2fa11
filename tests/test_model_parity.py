"""Greedy parity with Hugging Face: every family, block sizes, preemption, chunked prefill.

All prompts go through one `llm.generate` call, so they batch together, while the reference
runs each prompt alone through `transformers` `generate`. Token ids must match exactly.
"""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncengine import LLM, RequestOutput, SamplingParams
from asyncengine.testing import FAMILIES, HF_PROMPTS, train_bpe_tokenizer

if TYPE_CHECKING:
    from conftest import HFGreedy, ModelDirFactory

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_llm(model_dir: Path, **overrides: Any) -> LLM:
    """An `LLM` on the CPU in float32; `overrides` are `EngineArgs` fields."""
    args: dict[str, Any] = {
        "dtype": "float32",
        "device": "cpu",
        "seed": 0,
        "block_size": 16,
        # caps the KV cache the engine sizes for itself; all prompts still run at once
        "max_num_seqs": 16,
        **overrides,
    }
    return LLM(model=str(model_dir), **args)


@functools.cache
def encode_prompts(model_dir: Path) -> list[list[int]]:
    """`HF_PROMPTS` tokenized the way users' text is: AutoTokenizer, bos added."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(prompt).input_ids for prompt in HF_PROMPTS]


def assert_matches_hf(
    outs: list[RequestOutput],
    model_dir: Path,
    hf_greedy: HFGreedy,
    label: str,
    max_tokens: int = MAX_TOKENS,
) -> None:
    """Every output equals HF greedy over `max_tokens`; a failure lists each differing prompt
    and position."""
    prompts = encode_prompts(model_dir)
    assert len(outs) == len(prompts)
    problems = []
    for i, (out, prompt_token_ids) in enumerate(zip(outs, prompts, strict=True)):
        if out.error is not None:
            problems.append(f"prompt {i}: failed with {out.error!r}")
            continue
        if out.prompt_token_ids != prompt_token_ids:
            problems.append(f"prompt {i}: prompt_token_ids differ from AutoTokenizer's")
            continue
        got = out.outputs[0].token_ids
        expected = hf_greedy(model_dir, prompt_token_ids, max_tokens)
        if got != expected:
            pos = first_difference(got, expected)
            if pos == min(len(got), len(expected)):
                problems.append(f"prompt {i}: {len(got)} tokens, expected {len(expected)}")
            else:
                margin = hf_greedy.margin(model_dir, prompt_token_ids, pos)
                problems.append(
                    f"prompt {i} ({len(prompt_token_ids)} prompt tokens): first difference at "
                    f"output position {pos}: engine {got[pos]}, HF {expected[pos]} "
                    f"(HF top-2 logit margin there {margin:.2e})\n"
                    f"    engine {got}\n    HF     {expected}"
                )
        elif out.outputs[0].finish_reason != "length":
            problems.append(f"prompt {i}: finish_reason {out.outputs[0].finish_reason!r}")
    assert not problems, f"{label}: {len(problems)} of {len(outs)} prompts differ from HF\n" + (
        "\n".join(problems)
    )


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where `a` and `b` differ, or the shorter length if one prefixes the other."""
    pairs = zip(a, b, strict=False)
    return next((k for k, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))


def assert_nothing_left_behind(llm: LLM) -> None:
    st = llm.get_stats()
    assert (st.num_running, st.num_waiting, st.num_swapped) == (0, 0, 0)
    assert st.num_free_gpu_blocks == st.num_gpu_blocks
    assert st.num_free_cpu_blocks == st.num_cpu_blocks
    llm.llm_engine.block_manager.check_invariants()


# -- the testing utilities themselves ----------------------------------------------------------


def test_tokenizer_is_fast_deterministic_and_round_trips(tmp_path: Path) -> None:
    start = time.perf_counter()
    train_bpe_tokenizer(tmp_path / "a")
    assert time.perf_counter() - start < 2.0
    train_bpe_tokenizer(tmp_path / "b")
    first, second = (tmp_path / name / "tokenizer.json" for name in ("a", "b"))
    assert first.read_text() == second.read_text()

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert len(tokenizer) == 512
    unseen = "🦄 漢字 ∑ ünïcödé 🇯🇵"
    for text in [*HF_PROMPTS, unseen]:
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    lengths = [len(tokenizer(text).input_ids) for text in HF_PROMPTS]
    assert len(HF_PROMPTS) >= 8 and min(lengths) <= 4 and sorted(lengths)[-3] >= 200


def test_llama3_rope_scaling_survives_reload(model_dir: ModelDirFactory) -> None:
    path = model_dir("llama")
    saved = json.loads((path / "config.json").read_text())["rope_parameters"]
    assert saved["rope_type"] == "llama3" and saved["original_max_position_embeddings"] == 256
    model = AutoModelForCausalLM.from_pretrained(path)
    head_dim = model.config.head_dim
    unscaled = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    inv_freq = model.model.rotary_emb.inv_freq
    # high frequencies are kept, the lowest are divided by the factor (8)
    torch.testing.assert_close(inv_freq[:2], unscaled[:2])
    torch.testing.assert_close(inv_freq[-1], unscaled[-1] / 8)


@pytest.mark.parametrize("family", FAMILIES)
def test_random_models_give_varied_greedy_outputs(
    family: str, model_dir: ModelDirFactory, hf_greedy: HFGreedy
) -> None:
    path = model_dir(family)
    outputs = [tuple(hf_greedy(path, ids, MAX_TOKENS)) for ids in encode_prompts(path)]
    assert len(set(outputs)) == len(outputs), "two prompts give the same greedy output"
    assert min(len(set(out)) for out in outputs) >= 8, "a greedy output is nearly one token"


def test_hf_greedy_runs_past_eos(model_dir: ModelDirFactory, hf_greedy: HFGreedy) -> None:
    prompt_token_ids = encode_prompts(model_dir("llama"))[0]
    expected = hf_greedy(model_dir("llama"), prompt_token_ids, MAX_TOKENS)
    # same weights (same seed), but the token generated at step 3 is now the model's eos
    path = model_dir("llama", eos_token_id=expected[3])
    assert hf_greedy(path, prompt_token_ids, MAX_TOKENS) == expected


# -- engine parity -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity(family: str, model_dir: ModelDirFactory, hf_greedy: HFGreedy) -> None:
    path = model_dir(family)
    outs = make_llm(path).generate(HF_PROMPTS, GREEDY, use_tqdm=False)
    assert_matches_hf(outs, path, hf_greedy, family)


@pytest.mark.parametrize("block_size", [8, 512])
def test_greedy_parity_block_size(
    block_size: int, model_dir: ModelDirFactory, hf_greedy: HFGreedy
) -> None:
    path = model_dir("llama")
    outs = make_llm(path, block_size=block_size).generate(HF_PROMPTS, GREEDY, use_tqdm=False)
    assert_matches_hf(outs, path, hf_greedy, f"llama block_size={block_size}")


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_parity_under_preemption(
    mode: str, model_dir: ModelDirFactory, hf_greedy: HFGreedy
) -> None:
    path = model_dir("llama")
    block_size = 16
    blocks_per_request = [-(-(len(ids) + MAX_TOKENS) // block_size) for ids in encode_prompts(path)]
    # room for the largest request on its own, far from room for all of them at once
    num_gpu_blocks = max(blocks_per_request) + 1
    assert sum(blocks_per_request) > 2 * num_gpu_blocks
    llm = make_llm(
        path,
        block_size=block_size,
        num_gpu_blocks_override=num_gpu_blocks,
        num_cpu_blocks_override=sum(blocks_per_request),
        preemption_mode=mode,
    )
    outs = llm.generate(HF_PROMPTS, GREEDY, use_tqdm=False)
    assert_matches_hf(outs, path, hf_greedy, f"llama preemption_mode={mode}")
    st = llm.get_stats()
    if mode == "swap":
        assert st.num_preemptions_swap > 0
    else:
        assert st.num_preemptions_recompute > 0 and st.num_preemptions_swap == 0
    assert_nothing_left_behind(llm)


def test_greedy_parity_with_chunked_prefill(
    model_dir: ModelDirFactory, hf_greedy: HFGreedy
) -> None:
    path = model_dir("llama")
    max_num_batched_tokens = 64
    assert max(len(ids) for ids in encode_prompts(path)) > 4 * max_num_batched_tokens
    llm = make_llm(path, max_num_batched_tokens=max_num_batched_tokens)
    outs = llm.generate(HF_PROMPTS, GREEDY, use_tqdm=False)
    assert_matches_hf(outs, path, hf_greedy, "llama chunked prefill")
    assert_nothing_left_behind(llm)


def test_token_id_prompts_match_text_prompts(
    model_dir: ModelDirFactory, hf_greedy: HFGreedy
) -> None:
    path = model_dir("qwen2")
    llm = make_llm(path)
    from_text = llm.generate(HF_PROMPTS, GREEDY, use_tqdm=False)
    from_ids = llm.generate(encode_prompts(path), GREEDY, use_tqdm=False)
    assert_matches_hf(from_ids, path, hf_greedy, "qwen2 token-id prompts")
    assert [o.outputs[0].token_ids for o in from_ids] == [o.outputs[0].token_ids for o in from_text]
    assert_nothing_left_behind(llm)


def test_output_text_is_the_decoded_tokens(model_dir: ModelDirFactory) -> None:
    path = model_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    outs = make_llm(path).generate(HF_PROMPTS, GREEDY, use_tqdm=False)
    for i, out in enumerate(outs):
        completion = out.outputs[0]
        expected = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.text == expected, f"prompt {i}"


# -- bfloat16: the same tokens but for near-ties -----------------------------------------------

BF16_MAX_TOKENS = 96
# HF's logits are bf16: near its top logit L they come in steps of 2^(floor(log2 |L|) - 7). Two
# correct implementations round differently, and the difference grows through the layers, so a
# near-tie may be ordered either way. Over the four families (4,224 tokens) the engine's tokens
# that were not HF's argmax sat 0 steps below it (an exact tie) 29 times, 1 step 36, 2 steps 8,
# 3 steps twice; a wrong attention or layer moves logits by whole units, hundreds of steps.
BF16_TIE_STEPS = 4


def bf16_step(value: float) -> float:
    """The spacing of bfloat16 numbers around `value` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_greedy_parity_is_tie_aware(family: str, model_dir: ModelDirFactory) -> None:
    """Every generated token is HF-bf16's argmax given the engine's own prefix (teacher forcing,
    so a tie taken the other way early does not end the comparison), or a token HF scores
    within BF16_TIE_STEPS bf16 steps of its argmax."""
    path = model_dir(family)
    params = SamplingParams(temperature=0.0, max_tokens=BF16_MAX_TOKENS, ignore_eos=True)
    outs = make_llm(path, dtype="bfloat16").generate(HF_PROMPTS, params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    num_argmax = num_ties = 0
    problems = []
    for i, (out, prompt) in enumerate(zip(outs, encode_prompts(path), strict=True)):
        generated = out.outputs[0].token_ids
        assert out.error is None and len(generated) == BF16_MAX_TOKENS
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + generated])).logits[0].float()
        # row j predicts token j + 1: the rows that predicted each generated token
        for pos, token in enumerate(generated):
            row = logits[len(prompt) - 1 + pos]
            best = int(row.argmax())
            gap = float(row[best] - row[token])
            if token == best:
                num_argmax += 1
            elif gap <= BF16_TIE_STEPS * bf16_step(float(row[best])):
                num_ties += 1
            else:
                problems.append(
                    f"prompt {i} position {pos}: engine {token}, HF {best} (HF logit "
                    f"{float(row[best]):.3f}, {gap:.3f} above the engine's token)"
                )
    total = len(outs) * BF16_MAX_TOKENS
    agreement = f"{num_argmax / total:.1%} HF's argmax, {num_ties / total:.1%} near-ties"
    print(f"\n{family} bf16, {total} tokens: {agreement}")
    assert not problems, f"{family}: {len(problems)} tokens off ({agreement})\n" + "\n".join(
        problems[:10]
    )
