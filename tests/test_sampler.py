"""The sampler's batched path against a one-row reference written out here: the same
distribution per row whatever its batch mates ask for, the same token for a seeded row as it
draws alone, and draws that follow the distribution."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from asyncengine.errors import InvalidRequestError
from asyncengine.sampling_params import SamplingParams
from asyncengine.worker.sampler import Sampler, batched_probs_of, draw, invert_cdf, probs_of

VOCAB = 97

MIXED_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=1.5, top_k=20, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=0.4, top_k=VOCAB),  # top_k of the whole vocabulary: no filter
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=2.0, top_p=0.999),
]


def one_row_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """A row's distribution the plain way, one filter after another on the row alone."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


@dataclass
class Seq:
    """What the sampler reads of a request."""

    sampling_params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = (0,)
    num_output_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return []


def test_batched_probs_equal_each_rows_own() -> None:
    torch.manual_seed(0)
    logits = torch.randn(len(MIXED_PARAMS), VOCAB) * 3
    logits[2, :10] = logits[2, 10]  # ties at the top-p edge
    logits[1, 40:50] = logits[1].max()  # ties at the top-k edge
    batched = batched_probs_of(logits.clone(), MIXED_PARAMS)
    for row, params in enumerate(MIXED_PARAMS):
        assert torch.equal(batched[row], one_row_probs(logits[row], params)), params


def test_a_seeded_row_draws_what_it_draws_alone() -> None:
    torch.manual_seed(1)
    sampler = Sampler("cpu", seed=0)
    seeded = [
        Seq(SamplingParams(temperature=1.0, seed=7)),
        Seq(SamplingParams(temperature=0.8, top_p=0.6, seed=8), num_output_tokens=3),
    ]
    others = [Seq(SamplingParams(temperature=1.0)), Seq(SamplingParams(temperature=0.0))]
    logits = torch.randn(4, VOCAB)
    batch = [seeded[0], others[0], seeded[1], others[1]]
    tokens = sampler(logits.clone(), batch).token_ids  # type: ignore[arg-type]
    for row, seq in ((0, seeded[0]), (2, seeded[1])):
        alone = draw(probs_of(logits[row], seq.sampling_params), sampler.generator_for(seq))
        assert tokens[row] == alone
    assert tokens[3] == int(logits[3].argmax())  # greedy


@pytest.mark.parametrize("params", MIXED_PARAMS[:5], ids=str)
def test_batched_draws_follow_the_distribution(params: SamplingParams) -> None:
    """4,000 rows of the same logits in one batch: the tokens' frequencies within 0.05 of the
    distribution in total variation (a draw from the wrong one, or noise shared by rows, is
    far past it)."""
    torch.manual_seed(2)
    row = torch.randn(VOCAB) * 2
    sampler = Sampler("cpu", seed=3)
    num_rows = 4000
    seqs = [Seq(params) for _ in range(num_rows)]
    tokens = sampler(row.repeat(num_rows, 1), seqs).token_ids  # type: ignore[arg-type]
    seen = torch.bincount(torch.tensor(tokens), minlength=VOCAB).float() / num_rows
    expected = one_row_probs(row, params)
    expected = expected / expected.sum()
    assert 0.5 * float((seen - expected).abs().sum()) < 0.05
    assert float(seen[expected == 0].sum()) == 0.0  # nothing a filter removed


def test_the_inverse_cdf_never_picks_a_token_of_probability_zero() -> None:
    probs = torch.tensor([[0.0, 0.0, 0.3, 0.0, 0.7, 0.0], [0.0, 0.5, 0.0, 0.0, 0.0, 0.25]])
    below_one = 1.0 - 2.0**-24  # the largest float32 under 1: what torch.rand can give
    assert invert_cdf(probs, torch.tensor([0.0, 0.0])).tolist() == [2, 1]
    assert invert_cdf(probs, torch.tensor([below_one, below_one])).tolist() == [4, 5]
    # at the edge between two tokens: the next one, whose mass the draw is in
    assert invert_cdf(probs, torch.tensor([0.3, 2 / 3])).tolist() == [4, 5]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_are_the_only_tokens_sampled(model_dir, temperature: float) -> None:
    """vLLM's allowed_token_ids: every sample of every step comes from the list, greedy or
    not; the request's logprobs stay those of the model's own distribution."""
    from asyncengine import LLM

    llm = LLM(model=str(model_dir("llama")), device="cpu", dtype="float32")
    allowed = [7, 19, 300]
    params = SamplingParams(
        n=3, temperature=temperature, seed=5, max_tokens=20, ignore_eos=True,
        allowed_token_ids=allowed, logprobs=0,
    )  # fmt: skip
    [out] = llm.generate(["Once upon a time"], params, use_tqdm=False)
    for sample in out.outputs:
        assert len(sample.token_ids) == 20 and set(sample.token_ids) <= set(allowed)
        assert sample.logprobs is not None and len(sample.logprobs) == 20
    with pytest.raises(InvalidRequestError) as caught:
        llm.llm_engine.add_request("bad", "hi", SamplingParams(allowed_token_ids=[10**6]))
    assert caught.value.field == "allowed_token_ids"
