"""Shared fixtures: tiny random models per family and a cached Hugging Face greedy reference."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import failure_reports
import interrupts
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from asyncengine.logging import configure_logging
from asyncengine.testing import make_random_model, torch_threads

# in-process tests read the engine's INFO events (a library user's default is WARNING)
configure_logging("INFO")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(failure_reports, "failure_reports")


def pytest_sessionstart() -> None:
    """Ctrl-C: the first kills the test servers and stops the run, a second exits at once."""
    interrupts.install()


ModelDirFactory = Callable[..., Path]


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")` in tiny-model tests."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="session", autouse=True)
def cpu_ops_built() -> None:
    """Build the CPU ops once, before any test: engines in subprocesses (served models) then
    only load them, and no start-up waits on the compiler under a test's deadline."""
    from asyncengine.worker import cpu_ops

    cpu_ops.load()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> ModelDirFactory:
    """`model_dir(family="llama", **config_overrides) -> Path`, built once per session per args."""
    cache: dict[str, Path] = {}

    def make(family: str = "llama", **config_overrides: Any) -> Path:
        key = json.dumps([family, config_overrides], sort_keys=True)  # values may be dicts
        if key not in cache:
            out = tmp_path_factory.mktemp(f"model-{family}")
            cache[key] = make_random_model(out, family, **config_overrides)
        return cache[key]

    return make


class HFGreedy:
    """Hugging Face greedy decoding, one unpadded prompt at a time, cached per (model, prompt).

    Never stops at EOS (the engine side runs with `ignore_eos=True`) and never touches the logits:
    the generation config has no eos token at all rather than a `min_new_tokens` processor.
    """

    def __init__(self) -> None:
        self._models: dict[Path, Any] = {}  # *ForCausalLM; Any because mypy misses .generate
        # (model dir, prompt) -> (new token ids, top-1 minus top-2 logit at each step)
        self._results: dict[tuple[Path, tuple[int, ...]], tuple[list[int], list[float]]] = {}

    def __call__(
        self, model_dir: Path, prompt_token_ids: list[int], max_new_tokens: int
    ) -> list[int]:
        """The `max_new_tokens` token ids that follow `prompt_token_ids` under greedy decoding."""
        return self._run(model_dir, prompt_token_ids, max_new_tokens)[0][:max_new_tokens]

    def margin(self, model_dir: Path, prompt_token_ids: list[int], step: int) -> float:
        """How far the greedy pick at `step` was ahead of the runner-up (for failure messages)."""
        return self._run(model_dir, prompt_token_ids, step + 1)[1][step]

    def _run(
        self, model_dir: Path, prompt_token_ids: list[int], max_new_tokens: int
    ) -> tuple[list[int], list[float]]:
        key = (Path(model_dir), tuple(prompt_token_ids))
        cached = self._results.get(key)
        # greedy is a prefix-stable process, so a longer cached run answers a shorter request
        if cached is not None and len(cached[0]) >= max_new_tokens:
            return cached
        model = self._model(Path(model_dir))
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=model.config.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        input_ids = torch.tensor([prompt_token_ids])
        with torch.no_grad(), torch_threads(1):
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
        new_token_ids = out.sequences[0, len(prompt_token_ids) :].tolist()
        assert len(new_token_ids) == max_new_tokens, "HF generate stopped early"
        top2 = [scores[0].topk(2).values for scores in out.scores]
        margins = [float(values[0] - values[1]) for values in top2]
        self._results[key] = (new_token_ids, margins)
        return new_token_ids, margins

    def _model(self, model_dir: Path) -> Any:
        if model_dir not in self._models:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            # generate() falls back to the model's own generation config for an eos it is not
            # given (eos_token_id=None in ours counts as not given), so drop it there too
            model.generation_config.eos_token_id = None
            self._models[model_dir] = model.eval()
        return self._models[model_dir]


@pytest.fixture(scope="session")
def hf_greedy() -> HFGreedy:
    """`hf_greedy(model_dir, prompt_token_ids, max_new_tokens) -> list[int]`, session-cached."""
    return HFGreedy()
