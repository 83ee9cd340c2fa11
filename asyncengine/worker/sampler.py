"""Turn the last-position logits of each sampling request into its next token."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from asyncengine.core.request import Request
from asyncengine.outputs import RawLogprobs
from asyncengine.sampling_params import SamplingParams

_SEED_STRIDE = 1_000_003


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[RawLogprobs | None]
    # row -> the error that row's own processing raised (its token is not to be used)
    failures: dict[int, BaseException] = field(default_factory=dict)


@dataclass
class GrammarMasks:
    """The tokens each constrained row may sample this step, as xgrammar's packed bitmask."""

    bitmask: torch.Tensor  # int32 [num_sampling_rows, ceil(vocab_size / 32)], on the CPU
    rows: list[int]  # the rows to mask (the others are unconstrained, or allow every token)
    # row -> what failed in that row's grammar (its token is not to be used)
    failures: dict[int, BaseException] = field(default_factory=dict)


class SampledSeq(Protocol):
    """What a row's processing reads of its sequence: a `Request`, or one seen a few tokens
    ahead (speculative verification)."""

    sampling_params: SamplingParams
    token_ids: list[int]
    eos_token_ids: tuple[int, ...]

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def num_output_tokens(self) -> int: ...


class DraftGrammar(Protocol):
    """A constrained sample's grammar stepped over its drafts while they are verified, and
    put back after (the engine then advances it over the tokens the step keeps)."""

    def restrict(self, logits: torch.Tensor) -> None:
        """Set the tokens the grammar forbids next, in one row of logits, to -inf."""

    def advance(self, token_id: int) -> bool:
        """Take `token_id` (one the row allowed); True once the grammar has ended."""

    def rollback(self) -> None:
        """Undo every `advance`."""


class Grammars(Protocol):
    """The constraints of the step's requests, as the model runner applies them."""

    def fill_masks(self, reqs: list[Request]) -> GrammarMasks | None:
        """The grammar masks of the constrained rows of `reqs` (None: none is constrained)."""

    def for_drafts(self, req: Request) -> DraftGrammar | None:
        """`req`'s grammar to verify its drafts under (None: it is not constrained)."""


class Sampler:
    """Penalties, min_tokens masking, greedy or temperature/top-k/top-p/min-p sampling.

    A seeded request draws from a generator seeded by (seed, output position), so its tokens
    do not depend on what else is in the batch or on preemption.
    """

    def __init__(self, device: str, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, reqs: list[Request], grammar_masks: GrammarMasks | None = None
    ) -> SamplerOutput:
        """`grammar_masks` applies first: logprobs are those of the constrained distribution."""
        logits = logits.float()
        if grammar_masks is not None:
            _apply_grammar_masks(logits, grammar_masks)
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in reqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        # a row's own processing failing fails that request only, never the batch
        failures = dict(grammar_masks.failures) if grammar_masks is not None else {}
        for i, req in enumerate(reqs):
            try:
                apply_penalties_and_masks(logits[i], req)
            except Exception as exc:  # reported per request
                failures[i] = exc
        token_ids = logits.argmax(dim=-1).tolist()
        rows = [i for i, r in enumerate(reqs) if not r.sampling_params.is_greedy]
        if rows:
            try:
                sampled = self._sample_rows(logits, rows, reqs)
            except Exception:  # a row's own error: find it, and sample the others alone
                sampled = []
                for i in rows:
                    try:
                        sampled.append(self._sample_one(logits[i], reqs[i]))
                    except Exception as exc:
                        failures.setdefault(i, exc)
                        sampled.append(0)
            for i, token_id in zip(rows, sampled):
                token_ids[i] = token_id
        logprobs = self.logprobs_of(raw_logprobs, token_ids, reqs)
        return SamplerOutput(token_ids, logprobs, failures)

    def _sample_rows(self, logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> list[int]:
        """A token for each of the non-greedy `rows`, all at once: their distributions as one
        batch, each inverted at one uniform draw. A seeded row's draw comes from its own
        generator, as `draw` takes it, so its token is the one it would get sampled alone."""
        index = torch.tensor(rows, device=logits.device)
        params = [reqs[i].sampling_params for i in rows]
        probs = batched_probs_of(logits.index_select(0, index), params)
        uniform = torch.rand(len(rows), generator=self.generator, device=probs.device)
        for j, p in enumerate(params):
            if p.seed is not None:
                generator = self.generator_for(reqs[rows[j]])
                uniform[j] = torch.rand(1, generator=generator, device=probs.device)[0]
        return invert_cdf(probs, uniform).tolist()

    def _sample_one(self, logits: torch.Tensor, req: Request) -> int:
        params = req.sampling_params
        if params.is_greedy:
            return int(logits.argmax())
        return draw(probs_of(logits, params), self.generator_for(req))

    def generator_for(self, seq: SampledSeq) -> torch.Generator:
        """A seeded request's generator for its next output position; else the engine's."""
        seed = seq.sampling_params.seed
        if seed is None:
            return self.generator
        seed = (seed * _SEED_STRIDE + seq.num_output_tokens) % (1 << 63)
        return torch.Generator(self.device).manual_seed(seed)

    @staticmethod
    def logprobs_of(
        logprobs: torch.Tensor | None, token_ids: list[int], reqs: list[Request]
    ) -> list[RawLogprobs | None]:
        """Row i's entry for `token_ids[i]` (None where `reqs[i]` asked for no logprobs)."""
        if logprobs is None:
            return [None] * len(reqs)
        result: list[RawLogprobs | None] = []
        for row, token_id, req in zip(logprobs, token_ids, reqs):
            num_top = req.sampling_params.logprobs
            if num_top is None:
                result.append(None)
                continue
            chosen = row[token_id]
            entry = {token_id: float(chosen)}
            if num_top:
                top = torch.topk(row, num_top)
                # a grammar's forbidden tokens (-inf) are no alternatives
                pairs = zip(top.indices.tolist(), top.values.tolist())
                entry.update((t, v) for t, v in pairs if v != -math.inf)
            result.append(RawLogprobs(token_id, int((row > chosen).sum()) + 1, entry))
        return result


def probs_of(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy row samples from: temperature, top-k, top-p, min-p."""
    return batched_probs_of(logits.unsqueeze(0), [params])[0]


def batched_probs_of(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distributions non-greedy rows sample from ([rows, vocab], row i under `params[i]`):
    temperature, top-k, top-p, min-p, each filter on the rows that asked for it only, so a
    row's distribution does not depend on its batch mates."""
    temperatures = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    logits = logits / temperatures.to(logits.device).unsqueeze(1)
    vocab_size = logits.shape[1]
    top_k = [(j, p.top_k) for j, p in enumerate(params) if 0 < p.top_k < vocab_size]
    if top_k:
        rows = torch.tensor([j for j, _ in top_k], device=logits.device)
        ks = torch.tensor([k for _, k in top_k], device=logits.device)
        sub = logits.index_select(0, rows)
        kth = torch.topk(sub, int(ks.max())).values.gather(1, (ks - 1).unsqueeze(1))
        logits.index_copy_(0, rows, sub.masked_fill(sub < kth, -float("inf")))
    probs = torch.softmax(logits, dim=-1)
    top_p = [(j, p.top_p) for j, p in enumerate(params) if p.top_p < 1.0]
    if top_p:
        rows = torch.tensor([j for j, _ in top_p], device=probs.device)
        limits = torch.tensor([v for _, v in top_p], dtype=probs.dtype, device=probs.device)
        sorted_probs, order = probs.index_select(0, rows).sort(dim=1, descending=True)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop = sorted_probs.cumsum(1) - sorted_probs >= limits.unsqueeze(1)
        kept = torch.empty_like(sorted_probs).scatter_(
            1, order, sorted_probs.masked_fill(drop, 0.0)
        )
        probs.index_copy_(0, rows, kept)
    min_p = [(j, p.min_p) for j, p in enumerate(params) if p.min_p > 0.0]
    if min_p:
        rows = torch.tensor([j for j, _ in min_p], device=probs.device)
        floors = torch.tensor([v for _, v in min_p], dtype=probs.dtype, device=probs.device)
        sub = probs.index_select(0, rows)
        floor = floors.unsqueeze(1) * sub.max(dim=1, keepdim=True).values
        probs.index_copy_(0, rows, sub.masked_fill(sub < floor, 0.0))
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `probs` (which need not sum to 1)."""
    uniform = torch.rand(1, generator=generator, device=probs.device)
    return int(invert_cdf(probs.unsqueeze(0), uniform)[0])


def invert_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Row i's token where its cumulative distribution passes `uniform[i]` (in [0, 1)) of its
    total: a draw from it, never a token of probability zero. One random number a row: an
    exponential race (argmax of p / E, E ~ Exp(1)) draws one per token, and torch's CPU
    `exponential_` took 39 ms a step for 64 rows of a 32,000-token vocabulary (this: ~1 ms)."""
    cdf = probs.cumsum(dim=1)
    total = cdf[:, -1:]
    # strictly below the total, so the search lands on a token the mass rises at
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(uniform.to(cdf.dtype).unsqueeze(1) * total, below_total)
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return index.clamp_(max=probs.shape[1] - 1)  # an all-zero row: its last token


def prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_top: int
) -> list[RawLogprobs]:
    """Row i scores `target_ids[i]` (the prompt token after row i's position): its logprob and
    the top `num_top`, from the raw logits (no penalties: the prompt was not sampled)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, target_ids.unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    entries = [
        RawLogprobs(t, rank, {t: lp})
        for t, rank, lp in zip(target_ids.tolist(), ranks, chosen.squeeze(1).tolist())
    ]
    if num_top:
        top = torch.topk(logprobs, num_top, dim=-1)
        for entry, ids, values in zip(entries, top.indices.tolist(), top.values.tolist()):
            entry.logprobs.update(zip(ids, values))
    return entries


def _apply_grammar_masks(logits: torch.Tensor, masks: GrammarMasks) -> None:
    """Set each constrained row's forbidden tokens to -inf (xgrammar's kernel on CUDA)."""
    if not masks.rows:
        return
    import xgrammar as xgr

    bitmask = masks.bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=masks.rows)


def apply_penalties_and_masks(logits: torch.Tensor, req: SampledSeq) -> None:
    """One request's row, in place: penalties, logit bias, the allowed tokens, and the
    min_tokens ban on stops."""
    params = req.sampling_params
    if params.has_penalties:
        _apply_penalties(logits, req)
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
        bias = torch.tensor(list(params.logit_bias.values()), device=logits.device)
        logits[ids] += bias.to(logits.dtype)
    if params.allowed_token_ids:
        allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=logits.device)
        kept = logits[allowed]
        logits.fill_(-float("inf"))
        logits[allowed] = kept
    if req.num_output_tokens < params.min_tokens:
        banned = [*params.stop_token_ids]
        if not params.ignore_eos:
            banned += req.eos_token_ids
        kept = logits[banned]
        logits[banned] = -float("inf")
        is_constrained = params.structured_outputs is not None or params.allowed_token_ids
        if is_constrained and bool(torch.isneginf(logits).all()):
            # the grammar (or the allowed tokens) leave only a stop here: it wins over
            # min_tokens
            logits[banned] = kept


def _apply_penalties(logits: torch.Tensor, req: SampledSeq) -> None:
    params = req.sampling_params
    device = logits.device
    if params.repetition_penalty != 1.0:
        # as transformers and vLLM: over prompt and output tokens; shrink logits toward 0
        seen = torch.tensor(sorted(set(req.token_ids)), dtype=torch.long, device=device)
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    if params.presence_penalty or params.frequency_penalty:
        output = torch.tensor(req.output_token_ids, dtype=torch.long, device=device)
        counts = torch.bincount(output, minlength=logits.numel()).to(logits.dtype)
        logits -= params.frequency_penalty * counts
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
