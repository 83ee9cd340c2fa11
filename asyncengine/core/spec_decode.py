"""Speculative decoding's bookkeeping (no torch): when a request speculates, how many drafts,
and the counts of what was proposed and accepted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from asyncengine.config import SpeculativeConfig
from asyncengine.core.ngram import NgramProposer
from asyncengine.core.request import Request

# weight of the latest step in a request's moving acceptance rate
_ACCEPTANCE_WEIGHT = 0.3
# a request whose acceptance fell too low tries speculation again after this many decode steps
_RETRY_INTERVAL = 16


class PlanTimeProposer(Protocol):
    """A proposer the scheduler runs while it plans a step (one that needs no model)."""

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to `k` drafts to follow `req`'s tokens (possibly none)."""
        ...


@dataclass
class SpecResult:
    """What verification made of one request's drafts this step."""

    num_draft_tokens: int
    # the drafts the target agreed with, in order (the token sampled after them is not here)
    accepted_token_ids: list[int] = field(default_factory=list)


@dataclass
class SpecDecodeStats:
    """Counters of one proposer since start (vLLM's spec_decode metrics)."""

    method: str
    num_drafts: int = 0  # draft runs proposed (one per speculating request per step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted tokens by position in the draft run: how far acceptance reaches
    num_accepted_per_position: list[int] = field(default_factory=list)


class SpecDecodePolicy:
    """Speculation is turned off where it does not pay: in a step with many decoding requests
    (the forward is no longer memory-bound, so extra query rows cost compute), and for a
    request whose drafts are seldom accepted (each rejected draft is wasted work)."""

    def __init__(self, config: SpeculativeConfig, max_seq_len: int) -> None:
        self.config = config
        self.max_seq_len = max_seq_len
        self.stats = SpecDecodeStats(config.method)
        # prompt lookup needs no model: its drafts are found while the step is planned, so
        # slots are taken only for drafts that exist (a model's drafts are made by the runner)
        self.proposer: PlanTimeProposer | None = (
            NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            if config.method == "ngram"
            else None
        )

    def is_on_for(self, num_decodes: int) -> bool:
        return num_decodes <= self.config.disable_by_batch_size

    def num_spec_tokens(self, req: Request, num_budget_tokens: int) -> int:
        """Draft slots for `req` this step (0: none): never past its max_tokens, the cache
        or the step's token budget (`num_budget_tokens` left for it besides its own token)."""
        params = req.sampling_params
        if not self._is_worth_trying(req):
            return 0
        k = min(self.config.num_speculative_tokens, num_budget_tokens)
        k = min(k, self.max_seq_len - req.num_tokens)
        if params.max_tokens is not None:
            k = min(k, params.max_tokens - req.num_output_tokens - 1)
        return max(k, 0)

    def propose(self, req: Request, num_budget_tokens: int) -> tuple[int, list[int] | None]:
        """Draft slots for `req` this step (as `num_spec_tokens`) and, where the drafts are
        found now (prompt lookup), those drafts, as many as the slots; None: the runner's
        proposer fills the slots."""
        k = self.num_spec_tokens(req, num_budget_tokens)
        if not k or self.proposer is None:
            return k, None
        drafts = self.proposer.propose(req, k)
        return len(drafts), drafts

    def _is_worth_trying(self, req: Request) -> bool:
        if req.spec_acceptance >= self.config.min_acceptance_rate:
            return True
        req.num_steps_without_spec += 1
        if req.num_steps_without_spec < _RETRY_INTERVAL:
            return False
        req.num_steps_without_spec = 0
        return True

    def observe(self, req: Request, result: SpecResult) -> None:
        """Count one verified draft run of `req`."""
        num_drafts, num_accepted = result.num_draft_tokens, len(result.accepted_token_ids)
        if not num_drafts:
            return
        rate = num_accepted / num_drafts
        req.spec_acceptance += _ACCEPTANCE_WEIGHT * (rate - req.spec_acceptance)
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        per_position = stats.num_accepted_per_position
        per_position += [0] * (num_accepted - len(per_position))
        for i in range(num_accepted):
            per_position[i] += 1
