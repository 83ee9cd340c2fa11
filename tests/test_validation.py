"""Every invalid SamplingParams / EngineArgs field raises a ValueError that names it."""

from __future__ import annotations

import pytest

from asyncengine import EngineArgs, SamplingParams
from asyncengine.errors import InvalidRequestError
from asyncengine.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    StructuredOutputsParams,
)


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2**64),  # past what the engine process's messages carry: was an OverflowError
        ("max_tokens", 2**63),
        ("min_tokens", 10**30),
        # past what repr shows: was a bare ValueError naming no field
        pytest.param("top_k", 10**5000, id="top_k-5000-digits"),
        ("min_p", 1.5),
        ("seed", -1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("stop", [""]),
        ("stop", ["x" * (MAX_STOP_STRING_LEN + 1)]),
        ("stop", ["a"] * (MAX_STOP_STRINGS + 1)),
        ("stop", ["a"] * 1_000_000),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1)),
        ("logprobs", 21),
        ("truncate_prompt_tokens", 0),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [-1]),
        ("allowed_token_ids", list(range(MAX_ALLOWED_TOKEN_IDS + 1))),
        ("truncate_prompt_tokens", -2),
        ("temperature", float("nan")),
        ("top_p", float("nan")),
        ("presence_penalty", float("inf")),
        ("logit_bias", {1: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0)),
    ],
)
def test_bad_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**{field: value})
    assert caught.value.field == field
    assert isinstance(caught.value, ValueError)  # what vLLM raises, for code that catches it


def test_a_million_stop_strings_are_refused_by_count_before_any_scan() -> None:
    class Unscannable(list[str]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            raise AssertionError("the stop strings were walked before their count was checked")

    with pytest.raises(InvalidRequestError, match="at most"):
        SamplingParams(stop=Unscannable(["a"] * 1_000_000))


def test_min_tokens_above_max_tokens_is_rejected() -> None:
    with pytest.raises(InvalidRequestError, match=r"min_tokens: .*max_tokens") as caught:
        SamplingParams(min_tokens=10, max_tokens=5)
    assert caught.value.field == "min_tokens"


def test_sampling_params_defaults_and_normalisation() -> None:
    params = SamplingParams(stop="###", temperature=0.0)
    assert params.stop == ["###"]
    assert params.stop_token_ids == []
    assert params.is_greedy and not params.has_penalties
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "no top-k" (was refused)


@pytest.mark.parametrize(
    "field, value",
    [
        ("dtype", "float64"),
        ("device", "tpu"),
        ("block_size", 12),
        ("block_size", 4),
        ("block_size", 2048),
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.5),
        ("swap_space", -1),
        ("seed", -1),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("max_model_len", 0),
        ("num_gpu_blocks_override", 0),
        ("num_cpu_blocks_override", -1),
        ("preemption_mode", "drop"),
        ("attention_backend", "flash"),
        ("tensor_parallel_size", 0),
        ("tensor_parallel_size", 3),  # does not split 4 heads
        ("num_nodes", 0),
        ("distributed_timeout_s", 0),
        ("pipeline_parallel_size", 2),
        ("enable_chunked_prefill", False),
        ("quantization", "awq"),
    ],
)
def test_bad_engine_args_name_the_field(field: str, value: object, model_dir) -> None:
    args = EngineArgs(model=str(model_dir("llama")), **{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"EngineArgs\.{field}\b"):
        args.create_engine_config()


def test_batched_token_budget_must_cover_every_running_request(model_dir) -> None:
    args = EngineArgs(model=str(model_dir("llama")), max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match=r"EngineArgs\.max_num_batched_tokens .*max_num_seqs"):
        args.create_engine_config()


@pytest.mark.parametrize(("max_num_seqs", "given", "budget"), [
    (64, None, 512),  # a CPU step of 2048 tokens runs for hundreds of ms (config.py)
    (256, None, 512),
    (1024, None, 1024),  # never under max_num_seqs: every running request gets its token
    (64, 2048, 2048),  # a given budget is kept
])  # fmt: skip
def test_cpu_step_budget(max_num_seqs: int, given: int | None, budget: int, model_dir) -> None:
    args = EngineArgs(
        model=str(model_dir("llama")),
        device="cpu",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=given,
    )
    assert args.create_engine_config().scheduler_config.max_num_batched_tokens == budget


def test_max_model_len_cannot_exceed_the_model(model_dir) -> None:
    args = EngineArgs(model=str(model_dir("llama")), max_model_len=10**6)
    with pytest.raises(ValueError, match=r"EngineArgs\.max_model_len"):
        args.create_engine_config()


@pytest.mark.parametrize("block_size", [8, 16, 64, 512, 1024])
def test_every_power_of_two_block_size_is_accepted(block_size: int, model_dir) -> None:
    config = EngineArgs(model=str(model_dir("llama")), block_size=block_size).create_engine_config()
    assert config.cache_config.block_size == block_size


@pytest.mark.parametrize(
    "fields, field, shown",
    [
        ({"json": False}, "structured_outputs.json", "'bool'"),  # was: "set exactly one of ..."
        ({"regex": ""}, "structured_outputs.regex", "''"),  # was: got 'str'
        ({"grammar": 3}, "structured_outputs.grammar", "'int'"),
    ],
)
def test_a_bad_constraint_is_named_with_what_was_sent(
    fields: dict[str, object], field: str, shown: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        StructuredOutputsParams(**fields)  # type: ignore[arg-type]
    assert caught.value.field == field
    assert str(caught.value).endswith(f"got {shown}"), str(caught.value)
