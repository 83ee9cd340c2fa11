"""Verification of speculative drafts: the target scored a request's last token and its drafts
in one forward; keep each draft its own sampling would have kept, and the token after them.

For row j (the position after draft j-1), p is the target's distribution after the sampler's
processing as if drafts 0..j-1 were already outputs (penalties, logit bias, min_tokens,
temperature, top-k/p, min-p; the seed's generator for that output position). Drafts come from
deterministic proposers (prompt lookup, a greedy draft model), so the draft distribution q is
a point mass on draft x: the rule of Leviathan et al. / Chen et al. accepts x with probability
min(1, p(x) / q(x)) = p(x), and on rejection samples from the residual max(0, p - q),
normalized: p with x removed. Every output token is then distributed exactly as sampling
without speculation; greedy reduces to keeping the drafts equal to the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncengine.core.request import Request
from asyncengine.outputs import RawLogprobs
from asyncengine.sampling_params import SamplingParams
from asyncengine.worker.sampler import (
    DraftGrammar,
    Sampler,
    apply_penalties_and_masks,
    draw,
    probs_of,
)


class _Ahead:
    """`req` as it will be once `extra` tokens follow its last (the drafts before a row)."""

    def __init__(self, req: Request, extra: list[int]) -> None:
        self.sampling_params: SamplingParams = req.sampling_params
        self.eos_token_ids = req.eos_token_ids
        self.token_ids = req.token_ids + extra if extra else req.token_ids
        self._num_prompt_tokens = req.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self._num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self._num_prompt_tokens


@dataclass
class Verified:
    """The tokens one request gets this step: accepted drafts, then the token after them."""

    token_ids: list[int]
    logprobs: list[RawLogprobs] | None  # one per token, when the request asked for them

    @property
    def accepted_token_ids(self) -> list[int]:
        return self.token_ids[:-1]


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    req: Request,
    drafts: list[int],
    grammar: DraftGrammar | None = None,
) -> Verified:
    """`logits` [len(drafts) + 1, vocab]: row j scores the position after draft j - 1.

    Under a `grammar`, row j allows what the grammar allows after the drafts kept before it
    (a draft it forbids is rejected, as its probability is 0), and a draft that ends the
    grammar is the last token: nothing may follow it."""
    logits = logits.float()
    # logprobs as the sampler gives them: of the model, before processing, but under the
    # grammar (a constrained row's alternatives are what the grammar allows)
    raw_logprobs: list[torch.Tensor] | None = (
        [] if req.sampling_params.logprobs is not None else None
    )
    token_ids: list[int] = []
    try:
        for j, row in enumerate(logits):
            seq = _Ahead(req, token_ids)
            if grammar is not None:
                grammar.restrict(row)
            if raw_logprobs is not None:
                raw_logprobs.append(torch.log_softmax(row, dim=-1))
            apply_penalties_and_masks(row, seq)
            if j == len(drafts):  # every draft kept: the token after them is sampled as usual
                token_ids.append(_sample(sampler, row, seq))
                break
            token_id = _check(sampler, row, seq, drafts[j])
            token_ids.append(token_id)
            if token_id != drafts[j] or (grammar is not None and grammar.advance(token_id)):
                break
    finally:
        if grammar is not None:
            grammar.rollback()
    logprobs = None
    if raw_logprobs is not None:
        rows = torch.stack(raw_logprobs)
        entries = Sampler.logprobs_of(rows, token_ids, [req] * len(token_ids))
        logprobs = [entry for entry in entries if entry is not None]
    return Verified(token_ids, logprobs)


def _sample(sampler: Sampler, row: torch.Tensor, seq: _Ahead) -> int:
    params = seq.sampling_params
    if params.is_greedy:
        return int(row.argmax())
    return draw(probs_of(row, params), sampler.generator_for(seq))


def _check(sampler: Sampler, row: torch.Tensor, seq: _Ahead, draft: int) -> int:
    """The token at this row: `draft` if accepted, else one from the residual distribution."""
    params = seq.sampling_params
    if params.is_greedy:
        return int(row.argmax())
    probs = probs_of(row, params)
    generator = sampler.generator_for(seq)
    accept = float(probs[draft] / probs.sum())
    if float(torch.rand((), generator=generator, device=probs.device)) < accept:
        return draft
    probs[draft] = 0.0
    return draw(probs, generator)
