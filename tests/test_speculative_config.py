"""speculative_config (issue 29): vLLM's JSON shape in EngineArgs, LLM and `serve`; errors name
the field."""

from __future__ import annotations

import pytest

from asyncengine import EngineArgs
from asyncengine.config import SpeculativeConfig
from asyncengine.server.cli import build_parser
from asyncengine.server.engine_flags import engine_args_from


def config(model_dir, value, **overrides) -> SpeculativeConfig | None:
    args = EngineArgs(model=str(model_dir("llama")), device="cpu", speculative_config=value,
                      **overrides)  # fmt: skip
    return args.create_engine_config().speculative_config


def test_ngram_from_a_dict_or_its_json_text(model_dir) -> None:
    shape = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
             "prompt_lookup_min": 2}  # fmt: skip
    expected = SpeculativeConfig("ngram", 5, prompt_lookup_max=4, prompt_lookup_min=2)
    assert config(model_dir, shape) == expected
    assert config(model_dir, '{"method": "ngram", "num_speculative_tokens": 5, '
                  '"prompt_lookup_max": 4, "prompt_lookup_min": 2}') == expected  # fmt: skip
    assert config(model_dir, None) is None


@pytest.mark.parametrize(
    ("given", "expected"),
    [({}, (5, 5)), ({"prompt_lookup_max": 4}, (4, 4)), ({"prompt_lookup_min": 2}, (2, 2)),
     ({"prompt_lookup_min": 2, "prompt_lookup_max": 3}, (2, 3))],
)  # fmt: skip
def test_lookup_bounds_default_as_in_vllm(model_dir, given, expected) -> None:
    # vLLM: one bound given sets the other, neither means 5 and 5
    got = config(model_dir, {"method": "ngram", "num_speculative_tokens": 3, **given})
    assert got is not None
    assert (got.prompt_lookup_min, got.prompt_lookup_max) == expected


def test_a_model_means_a_draft_model(model_dir) -> None:
    draft = model_dir("llama", num_hidden_layers=1)
    got = config(model_dir, {"model": str(draft), "num_speculative_tokens": 3})
    assert got is not None and got.method == "draft_model" and got.model == str(draft)


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ('{"method": "ngram"', "speculative_config"),
        ("[1]", "speculative_config"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        ({"method": "eagle9", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram", "num_speculative_tokens": 0},
         "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99},
         "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True},  # JSON's true: was taken as 1
         "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": True},
         "speculative_config.prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
         "speculative_config.prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
          "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1},
         "speculative_config.lookahead"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
         "speculative_config.disable_by_batch_size"),
    ],
)  # fmt: skip
def test_bad_configs_name_their_field(model_dir, value, field) -> None:
    with pytest.raises(ValueError, match=rf"EngineArgs\.{field}"):
        config(model_dir, value)


def test_a_draft_model_must_share_the_vocabulary(model_dir) -> None:
    other = model_dir("llama", vocab_size=600)
    with pytest.raises(ValueError, match=r"speculative_config\.model must be a model with the "):
        config(model_dir, {"model": str(other), "num_speculative_tokens": 2})


def test_serve_takes_the_json_object() -> None:
    text = '{"method": "ngram", "num_speculative_tokens": 3}'
    ns = build_parser().parse_args(["serve", "--speculative-config", text])
    assert engine_args_from(ns).speculative_config == text
