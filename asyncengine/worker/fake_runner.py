"""A model runner with no model: it emits scripted tokens instantly.

For tests of everything around the forward (scheduling, streaming, detokenization, stops) and
for benchmarks of the loop's own overhead.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncengine.config import EngineConfig
from asyncengine.core.request import Request
from asyncengine.core.scheduler import SchedulerOutput
from asyncengine.worker.model_runner import ModelRunnerOutput
from asyncengine.worker.sampler import Grammars

# next token of a request, given the request (its tokens so far)
TokenScript = Callable[[Request], int]

_DEFAULT_NUM_BLOCKS = 4096


def count_up(vocab_size: int) -> TokenScript:
    """A script whose next token depends only on the tokens so far (so recompute is exact)."""
    return lambda req: (sum(req.token_ids[-4:]) * 31 + req.num_tokens) % (vocab_size - 4) + 4


class FakeModelRunner:
    """Same interface as `ModelRunner`; samples `script(req)` for each request that needs one."""

    def __init__(self, config: EngineConfig, script: TokenScript) -> None:
        self.config = config
        self.script = script
        self.num_steps = 0

    def determine_num_blocks(self) -> tuple[int, int]:
        cache = self.config.cache_config
        num_gpu = cache.num_gpu_blocks_override or _DEFAULT_NUM_BLOCKS
        num_cpu = cache.num_cpu_blocks_override
        return num_gpu, _DEFAULT_NUM_BLOCKS if num_cpu is None else num_cpu

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def execute_model(
        self, plan: SchedulerOutput, grammars: Grammars | None = None
    ) -> ModelRunnerOutput:
        """Scripted tokens; grammars are not applied (a constrained request fails)."""
        self.num_steps += 1
        sampled = {}
        for req in plan.scheduled:
            if (
                req.num_computed_tokens + plan.num_scheduled_tokens[req.request_id]
                == req.num_tokens
            ):
                sampled[req.request_id] = self.script(req)
        return ModelRunnerOutput(sampled_token_ids=sampled)
