"""attention_backend="triton" end to end: the layer-level backend, block moves, HF parity."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from kv_inputs import assert_close, make_paged_kv
from test_model_parity import assert_matches_hf, assert_nothing_left_behind, make_llm

from asyncengine import EngineArgs, SamplingParams
from asyncengine.core.scheduler import SchedulerOutput
from asyncengine.testing import HF_PROMPTS
from asyncengine.worker.attention import torch_attention
from asyncengine.worker.cache_engine import CacheEngine
from asyncengine.worker.forward_context import AttentionMetadata

if TYPE_CHECKING:
    from types import ModuleType

    from conftest import HFGreedy, ModelDirFactory

# The interpreter runs each decode program in Python, ~3 s a step for HF_PROMPTS: 8 tokens (not
# test_model_parity's 32) still take the decodes of 5 of the 11 prompts across a block boundary.
BLOCK_SIZE, MAX_TOKENS = 16, 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def num_decodes_crossing_a_block(prompt_lens: list[int]) -> int:
    """How many sequences write a decode token's K/V at the first slot of a new block."""
    # decode steps write positions len .. len + MAX_TOKENS - 2 (the last token is not fed back)
    return sum(any(p % BLOCK_SIZE == 0 for p in range(n, n + MAX_TOKENS - 1)) for n in prompt_lens)


def mixed_batch(
    new_lens: list[int], context_lens: list[int], block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, AttentionMetadata]:
    """A KV cache and the metadata of one step, decodes (one new token) first, as the runner
    builds them."""
    seq_lens = [c + n for c, n in zip(context_lens, new_lens)]
    kv = make_paged_kv(seq_lens, block_size, 2, 64, dtype, share_prefix=False)
    tables = kv.block_tables.tolist()
    slots = [
        tables[i][p // block_size] * block_size + p % block_size
        for i, (c, n) in enumerate(zip(context_lens, new_lens))
        for p in range(c, c + n)
    ]
    starts = [0, *torch.tensor(new_lens).cumsum(0).tolist()]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=kv.block_tables,
        seq_lens=kv.seq_lens,
        query_start_loc=starts,
        context_lens=context_lens,
        seq_lens_list=seq_lens,
        num_decodes=sum(1 for n in new_lens if n == 1),
        max_seq_len=max(seq_lens),
    )
    # the engine's cache starts zeroed: the torch backend weighs unused slots by 0
    return kv.kv_cache.nan_to_num(0.0), meta


@pytest.mark.parametrize(
    "block_size, sliding_window, dtype",
    [(16, None, torch.float32), (8, 12, torch.float32), (512, None, torch.bfloat16)],
)
def test_triton_backend_matches_torch_backend(
    kernels: ModuleType, block_size: int, sliding_window: int | None, dtype: torch.dtype
) -> None:
    from asyncengine.worker.triton_attention import triton_attention

    # decodes, then a fresh prompt, a chunk after a cached prefix, a resumed request
    new_lens, context_lens = [1, 1, 1, 9, 20, 3], [0, 17, 40, 0, 25, 33]
    kv_cache, meta = mixed_batch(new_lens, context_lens, block_size, dtype)
    num_tokens = sum(new_lens)
    query = torch.randn(num_tokens, 8, 64).to(dtype)
    key, value = torch.randn(2, num_tokens, 2, 64).to(dtype)
    expected_cache = kv_cache.clone()
    out = triton_attention(query, key, value, kv_cache, meta, 0.125, sliding_window)
    expected = torch_attention(query, key, value, expected_cache, meta, 0.125, sliding_window)
    torch.testing.assert_close(kv_cache, expected_cache, rtol=0, atol=0)
    assert_close(out, expected, dtype)


def test_cache_engine_moves_blocks_like_the_torch_path(kernels: ModuleType) -> None:
    engines = [
        CacheEngine(2, 2, 64, 8, 6, 4, torch.float32, "cpu", use_triton_kernels=use)
        for use in (True, False)
    ]
    for pools in zip(*[(e.gpu_cache, e.cpu_cache) for e in engines]):
        for triton_layer, torch_layer in zip(*pools):
            torch_layer.copy_(torch.randn_like(torch_layer))
            triton_layer.copy_(torch_layer)
    plan = SchedulerOutput(
        blocks_to_swap_out=[(1, 0), (4, 2)],
        blocks_to_swap_in=[(3, 1)],  # into a block freed by the swap-out
        blocks_to_copy=[(0, 5), (2, 4)],
    )
    for engine in engines:
        engine.apply(plan)
    for a, b in zip(engines[0].gpu_cache + engines[0].cpu_cache,
                    engines[1].gpu_cache + engines[1].cpu_cache):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_auto_picks_torch_on_cpu_and_triton_needs_the_interpreter(
    model_dir: ModelDirFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(model_dir("llama"))
    auto = EngineArgs(model=path, device="cpu").create_engine_config()
    assert auto.device_config.attention_backend == "torch"
    explicit = EngineArgs(model=path, device="cpu", attention_backend="triton")
    assert explicit.create_engine_config().device_config.attention_backend == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"EngineArgs\.attention_backend .*TRITON_INTERPRET"):
        explicit.create_engine_config()


def test_greedy_parity_with_triton_backend(
    kernels: ModuleType, model_dir: ModelDirFactory, hf_greedy: HFGreedy
) -> None:
    path: Path = model_dir("llama")
    llm = make_llm(path, attention_backend="triton", block_size=BLOCK_SIZE)
    outs = llm.generate(HF_PROMPTS, GREEDY, use_tqdm=False)
    assert num_decodes_crossing_a_block([len(o.prompt_token_ids) for o in outs]) >= 3
    assert_matches_hf(outs, path, hf_greedy, "llama attention_backend=triton", MAX_TOKENS)
    assert_nothing_left_behind(llm)


def test_greedy_parity_with_triton_backend_under_swap_preemption(
    kernels: ModuleType, model_dir: ModelDirFactory, hf_greedy: HFGreedy
) -> None:
    path: Path = model_dir("llama")
    llm = make_llm(
        path,
        attention_backend="triton",
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=40,
        num_cpu_blocks_override=200,
        preemption_mode="swap",
    )
    outs = llm.generate(HF_PROMPTS, GREEDY, use_tqdm=False)
    label = "llama attention_backend=triton, swap preemption"
    assert_matches_hf(outs, path, hf_greedy, label, MAX_TOKENS)
    assert llm.get_stats().num_preemptions_swap > 0
    assert_nothing_left_behind(llm)
