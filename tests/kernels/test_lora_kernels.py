"""lora_shrink / lora_expand against their torch references: ranks, widths, mixed slots."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from conftest import ModelDirFactory

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    "num_rows, num_in, num_out, rank, dtype",
    [(1, 64, 32, 4, F32), (9, 100, 48, 8, F32), (17, 64, 130, 16, F16), (5, 256, 64, 3, BF16)],
)
def test_shrink_then_expand_matches_the_reference(
    kernels: ModuleType, num_rows: int, num_in: int, num_out: int, rank: int, dtype: torch.dtype
) -> None:
    num_slots = 3
    torch.manual_seed(num_rows + rank)
    x = torch.randn(num_rows, num_in).to(dtype)
    a_stack = (torch.randn(num_slots, rank, num_in) / num_in**0.5).to(dtype)
    b_stack = (torch.randn(num_slots, num_out, rank) / rank**0.5).to(dtype)
    scalings = torch.tensor([2.0, 0.5, 1.25])
    slots = torch.randint(-1, num_slots, (num_rows,))
    slots[0] = 1  # at least one row with an adapter
    y = kernels.lora_shrink(x, a_stack, slots)
    expected_y = kernels.lora_shrink_ref(x, a_stack, slots)
    torch.testing.assert_close(y, expected_y, rtol=1e-4, atol=1e-4)
    # the output a column slice of a wider fused projection, as q/k/v are
    wide = torch.randn(num_rows, num_out + 7).to(dtype)
    expected = wide.clone()
    kernels.lora_expand(wide[:, 7:], y, b_stack, scalings, slots)
    kernels.lora_expand_ref(expected[:, 7:], expected_y, b_stack, scalings, slots)
    tol = 1e-4 if dtype == F32 else 2e-2
    torch.testing.assert_close(wide, expected, rtol=tol, atol=tol)
    base = slots < 0
    assert torch.equal(wide[base], expected[base]) and torch.equal(
        y[base], torch.zeros_like(y[base])
    )
    assert torch.equal(wide[:, :7], expected[:, :7])


def test_rows_without_an_adapter_and_no_rows(kernels: ModuleType) -> None:
    x, a_stack = torch.randn(4, 32), torch.randn(2, 4, 32)
    slots = torch.full((4,), -1, dtype=torch.int32)
    assert torch.equal(kernels.lora_shrink(x, a_stack, slots), torch.zeros(4, 4))
    out = torch.randn(0, 16)
    kernels.lora_expand(out, torch.zeros(0, 4), torch.randn(2, 16, 4), torch.ones(2), slots[:0])


def test_mismatched_inputs_are_refused(kernels: ModuleType) -> None:
    x, a_stack, slots = torch.randn(3, 32), torch.randn(2, 4, 32), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="a_stack"):
        kernels.lora_shrink(x, torch.randn(2, 4, 16), slots)
    with pytest.raises(ValueError, match="slots"):
        kernels.lora_shrink(x, a_stack, slots.float())
    with pytest.raises(ValueError, match="y must be"):
        kernels.lora_expand(
            torch.zeros(3, 8), torch.zeros(3, 5), torch.randn(2, 8, 4), torch.ones(2), slots
        )


def test_the_triton_backend_runs_adapters_as_peft_does(
    kernels: ModuleType,
    model_dir: ModelDirFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from test_lora import GREEDY, make_llm, peft_greedy

    from asyncengine import LoRARequest
    from asyncengine.testing import make_random_lora

    path = model_dir("llama")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora_dir = make_random_lora(tmp_path / "lora", path, seed=5, r=4, target_modules=targets)
    lora = LoRARequest("all", 1, str(lora_dir))
    llm = make_llm(path, attention_backend="triton", max_loras=1)
    rows_shrunk = []
    shrink = kernels.lora_shrink

    def counting_shrink(x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        rows_shrunk.append(x.shape[0])
        return shrink(x, *args)

    monkeypatch.setattr(kernels, "lora_shrink", counting_shrink)
    prompts = [[0, 11, 42, 7, 300], [0, 99, 5], [0, 23, 23, 400, 8, 1]]
    per_prompt = [lora, None, lora]
    outs = llm.generate(prompts, GREEDY, lora_request=per_prompt)
    for prompt, lora_of, out in zip(prompts, per_prompt, outs, strict=True):
        assert out.outputs[0].token_ids == peft_greedy(path, lora_of, prompt)
    assert rows_shrunk  # the kernels computed the deltas
