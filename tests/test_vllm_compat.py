"""vLLM code ports by changing the import: its module paths, its everyday arguments, and
`LLM.get_tokenizer` / `LLM.chat`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import asyncengine
from asyncengine import LLM, EngineArgs, SamplingParams
from asyncengine.config import cpu_bf16_flag
from asyncengine.testing import CHAT_TEMPLATE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
HELLO = [{"role": "user", "content": "Hello, my name is"}]


def test_engine_args_import_from_vllms_module_path_and_are_the_same_classes() -> None:
    from asyncengine.engine.arg_utils import AsyncEngineArgs
    from asyncengine.engine.arg_utils import EngineArgs as ArgUtilsEngineArgs

    assert ArgUtilsEngineArgs is asyncengine.EngineArgs
    assert AsyncEngineArgs is asyncengine.AsyncEngineArgs
    assert issubclass(AsyncEngineArgs, EngineArgs)
    assert AsyncEngineArgs(disable_log_requests=True).disable_log_requests


def test_everyday_vllm_arguments_are_accepted(model_dir) -> None:
    path = str(model_dir("llama"))
    llm = LLM(
        model=path,
        tokenizer=path,
        trust_remote_code=True,
        enforce_eager=True,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        disable_log_stats=True,
        enable_chunked_prefill=True,
        quantization=None,
        seed=0,
        dtype="float32",
        device="cpu",
        max_num_seqs=4,
        max_model_len=128,
        swap_space=0.01,
        gpu_memory_utilization=0.5,
        block_size=16,
    )
    (out,) = llm.generate(["Hello, my name is"], GREEDY)
    assert len(out.outputs[0].token_ids) == 6


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("half", "float16"),
        ("float", "float32"),
        (torch.bfloat16, "bfloat16"),
        ("auto", "bfloat16" if cpu_bf16_flag() else "float32"),
    ],
)
def test_dtype_takes_vllms_and_torchs_names(model_dir, dtype: object, expected: str) -> None:
    args = EngineArgs(model=str(model_dir("llama")), device="cpu", dtype=dtype)  # type: ignore[arg-type]
    assert args.create_engine_config().model_config.dtype == expected


def test_a_tensor_parallel_size_that_does_not_split_the_model_is_a_clear_error(model_dir) -> None:
    # N=2 runs (tests/test_tensor_parallel.py); 3 ranks cannot share 4 heads
    with pytest.raises(ValueError, match=r"EngineArgs\.tensor_parallel_size must be a .*got 3"):
        LLM(model=str(model_dir("llama")), device="cpu", tensor_parallel_size=3)


# -- get_tokenizer and chat ------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_llm(model_dir) -> LLM:
    path = model_dir("llama", chat_template=CHAT_TEMPLATE)
    return LLM(model=str(path), dtype="float32", device="cpu", num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def plain_llm(model_dir) -> LLM:
    """A model whose tokenizer has no chat template."""
    return LLM(model=str(model_dir("llama")), dtype="float32", device="cpu")


def test_get_tokenizer_is_what_text_prompts_are_encoded_with(plain_llm: LLM) -> None:
    tokenizer = plain_llm.get_tokenizer()
    (out,) = plain_llm.generate(["양자역학 설명해줄래?"], GREEDY)
    assert out.prompt_token_ids == tokenizer.encode("양자역학 설명해줄래?")


@pytest.mark.parametrize("prompt_kind", ["text", "ids"])
def test_truncate_prompt_tokens_keeps_the_prompts_end(plain_llm: LLM, prompt_kind: str) -> None:
    """vLLM's SamplingParams.truncate_prompt_tokens: the last k prompt tokens are the prompt;
    -1 keeps up to the context length (here all of a short prompt)."""
    text = "The quick brown fox jumps over the lazy dog, again and again and again."
    ids = plain_llm.get_tokenizer().encode(text)
    prompt: str | list[int] = text if prompt_kind == "text" else ids
    kept = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, truncate_prompt_tokens=5)
    keep_all = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, truncate_prompt_tokens=-1
    )
    truncated, whole = plain_llm.generate([prompt, prompt], [kept, keep_all])
    (expected,) = plain_llm.generate([ids[-5:]], GREEDY)
    assert truncated.prompt_token_ids == ids[-5:]
    assert truncated.outputs[0].token_ids == expected.outputs[0].token_ids
    assert whole.prompt_token_ids == ids


def test_chat_renders_the_template_opens_the_reply_and_adds_no_second_bos(chat_llm: LLM) -> None:
    tokenizer = chat_llm.get_tokenizer()
    (out,) = chat_llm.chat(HELLO, GREEDY)
    rendered = "<s><|user|>\nHello, my name is</s>\n<|assistant|>\n"
    assert out.prompt == rendered
    assert out.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids.count(tokenizer.bos_token_id) == 1
    (same,) = chat_llm.generate([out.prompt_token_ids], GREEDY)
    assert out.outputs[0].token_ids == same.outputs[0].token_ids


def test_chat_takes_a_list_of_conversations_and_answers_in_order(chat_llm: LLM) -> None:
    conversations = [
        HELLO,
        [
            {"role": "system", "content": "Answer in Korean."},
            {"role": "user", "content": "재미있는 이야기 들려줘"},
        ],
    ]
    outs = chat_llm.chat(conversations, GREEDY)
    assert [out.prompt for out in outs] == [
        "<s><|user|>\nHello, my name is</s>\n<|assistant|>\n",
        "<s><|system|>\nAnswer in Korean.</s>\n"
        "<|user|>\n재미있는 이야기 들려줘</s>\n<|assistant|>\n",
    ]
    (single,) = chat_llm.chat(conversations[1], GREEDY)
    assert outs[1].outputs[0].token_ids == single.outputs[0].token_ids


def test_a_given_template_renders_where_the_model_has_none(plain_llm: LLM, tmp_path: Path) -> None:
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}=>"
    (out,) = plain_llm.chat(HELLO, GREEDY, chat_template=template)
    assert out.prompt == "<s>Hello, my name is =>"
    template_file = tmp_path / "template.jinja"
    template_file.write_text(template)
    (from_file,) = plain_llm.chat(HELLO, GREEDY, chat_template=str(template_file))
    assert from_file.prompt == out.prompt
    assert from_file.outputs[0].token_ids == out.outputs[0].token_ids


def test_chat_without_any_template_is_a_clear_error(plain_llm: LLM) -> None:
    with pytest.raises(ValueError, match="has no chat template: pass chat_template="):
        plain_llm.chat(HELLO, GREEDY)
    with pytest.raises(ValueError, match="messages is empty"):
        plain_llm.chat([], GREEDY)


SCRIPT = """
from asyncengine import LLM, SamplingParams
llm = LLM(model={model!r}, device="cpu", dtype="float32", num_gpu_blocks_override=64)
print(llm.generate(["Hello"], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].text)
"""


def run_script(model: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.format(model=str(model))],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ASYNCENGINE_LOG_LEVEL": "", "OMP_NUM_THREADS": "1", **env},
    )


def test_a_script_using_llm_logs_nothing_below_warning_unless_asked(model_dir) -> None:
    model = model_dir("llama")
    quiet = run_script(model)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip()  # it generated
    assert '"level": "info"' not in quiet.stderr and "engine_started" not in quiet.stderr

    verbose = run_script(model, ASYNCENGINE_LOG_LEVEL="INFO")
    assert verbose.returncode == 0, verbose.stderr
    events = [json.loads(line)["event"] for line in verbose.stderr.splitlines() if "{" in line]
    assert "engine_started" in events


def test_a_bad_log_level_in_the_environment_is_named(model_dir) -> None:
    bad = run_script(model_dir("llama"), ASYNCENGINE_LOG_LEVEL="LOUD")
    assert bad.returncode != 0
    assert "ASYNCENGINE_LOG_LEVEL must be DEBUG, INFO, WARNING or ERROR, got 'LOUD'" in bad.stderr
