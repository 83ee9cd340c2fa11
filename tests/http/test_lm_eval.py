"""lm-eval's `local-completions` model, as an evaluation runs it, against `serve --http-port`: a
local task of multiple-choice items scored by loglikelihood and generate_until items, in both of
its request modes; every per-item loglikelihood equals transformers' on the same weights and the
same token split, and every generation is transformers' greedy text cut at the task's stop.

The modes: `tokenized_requests=True` (lm-eval's default) sends token ids, which the server takes
as they are; `False` sends the text those ids decode to, which the server tokenizes. lm-eval
slices the echoed prompt's logprobs at the context's token count, so the server's tokens must
be lm-eval's: a tokenizer that prepends `<s>` to text (Llama's) shifts that slice by one token
(vLLM does the same; lm-eval's completions payload has no `add_special_tokens` to opt out). The
text mode therefore runs on the same weights with a tokenizer that adds no BOS, as GPT-2's and
Qwen2's byte-level tokenizers add none; the token-id mode on the Llama-3-style one that does.

The server is serving_http's (`serve --http-port 0`), its engine stepping on the server's loop
(`--no-engine-process`): what is checked here is the HTTP API's numbers, and the other HTTP tests
run both cores. No download: the task is a YAML over local jsonl files (lm-eval's built-in tasks
are not even indexed), datasets and the hub are offline, and any socket connect beyond loopback
fails the test. lm-eval is in the `clients` extra; without it this module skips, except under
CI, which installs it and where a missing lm-eval is a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from serving_http import http_server
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

if not os.environ.get("CI"):
    pytest.importorskip(
        "lm_eval", reason="lm-eval is in the clients extra: pip install -e '.[clients]'"
    )

CHOICE_ITEMS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Rome"], "answer": 0},
    {"question": "def add(a, b):\n    return", "choices": ["a + b", "a - b", "None"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["three", "four", "five", "six"], "answer": 1},
    {"question": "한국어로 인사는", "choices": ["안녕하세요", "감사합니다"], "answer": 0},
    {"question": "The block table maps logical blocks to", "choices": ["physical blocks", "tokens"],
     "answer": 0},
]  # fmt: skip
UNTIL_ITEMS = [
    {"prompt": "The scheduler runs", "target": " every step"},
    {"prompt": "class Block:\n    def __init__(self", "target": ", block_id):"},
    {"prompt": "Once upon a time,", "target": " there was"},
]
# "ing": a stop this random model's greedy text reaches (it never writes a newline)
MAX_GEN_TOKS, UNTIL = 12, ["\n", "ing"]
TOLERANCE = 1e-4  # nats, float32 on both sides


def task_yaml(name: str, data_file: Path, body: str) -> str:
    """A task over one local jsonl file (datasets' json builder, its cache beside the file)."""
    return (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n"
        f"  data_files:\n    test: {json.dumps(str(data_file))}\n"
        f"  cache_dir: {json.dumps(str(data_file.parent / 'cache'))}\n"
        f"test_split: test\n{body}"
    )


CHOICE_TASK = """\
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
UNTIL_TASK = f"""\
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: {json.dumps(UNTIL)}
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two lm-eval tasks, `ae_choice` and `ae_until`, over jsonl files beside their YAML."""
    out = tmp_path_factory.mktemp("lm-eval-tasks")
    tasks = [("ae_choice", CHOICE_ITEMS, CHOICE_TASK), ("ae_until", UNTIL_ITEMS, UNTIL_TASK)]
    for name, items, body in tasks:
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(item) + "\n" for item in items))
        (out / f"{name}.yaml").write_text(task_yaml(name, data, body))
    return out


@pytest.fixture(scope="module")
def no_bos_model(model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' tiny Llama with its tokenizer's post-processor (the `<s>` it prepends) removed."""
    out = tmp_path_factory.mktemp("model-llama-no-bos") / "llama"
    shutil.copytree(model_dir("llama"), out)
    tokenizer_json = json.loads((out / "tokenizer.json").read_text())
    tokenizer_json["post_processor"] = None
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("Answer").input_ids == tokenizer("Answer", add_special_tokens=False).input_ids
    return out


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """Any socket connect beyond this machine raises (lm-eval, datasets and the hub must not)."""
    connect = socket.socket.connect

    def guarded(self: socket.socket, address: Any) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            assert address[0] in ("127.0.0.1", "::1", "localhost"), f"network: {address}"
        connect(self, address)

    socket.socket.connect = guarded  # type: ignore[method-assign]
    try:
        yield
    finally:
        socket.socket.connect = connect  # type: ignore[method-assign]


def evaluate(base_url: str, model: Path, tasks_dir: Path, tokenized_requests: bool) -> dict:
    """lm-eval's in-process entry point, as `lm_eval --model local-completions` calls it."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": "tiny-llama",
            "base_url": f"{base_url}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(model),
            "tokenized_requests": tokenized_requests,
            "max_retries": 1,
            "timeout": 120,
        },
        tasks=["ae_choice", "ae_until"],
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
        log_samples=True,
    )


class Oracle:
    """transformers on the served weights, in float32."""

    def __init__(self, model: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def loglikelihood(self, context: str, continuation: str) -> tuple[float, bool]:
        """log P(continuation | context) over the tokens of `context + continuation` after the
        context's own (lm-eval's split), and whether each was the argmax."""
        whole, context_ids = self.encode(context + continuation), self.encode(context)
        assert whole[: len(context_ids)] == context_ids, "the item splits inside a token"
        with torch.no_grad():
            logits = self.model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
        scores = logits[len(context_ids) - 1 : -1]
        targets = torch.tensor(whole[len(context_ids) :])
        total = scores.gather(1, targets[:, None]).sum().item()
        return total, bool((scores.argmax(-1) == targets).all())

    def generate(self, hf_greedy: Any, model: Path, context: str) -> tuple[str, bool, float]:
        """Greedy text for `context` as the server ends it (EOS, then the stop strings), whether
        a stop string ended it, and the smallest top-1 margin on the way (a near tie may
        rightly go the other way)."""
        prompt_ids = self.encode(context)
        ids = hf_greedy(model, prompt_ids, MAX_GEN_TOKS)
        num_ids = (
            ids.index(self.tokenizer.eos_token_id) + 1
            if self.tokenizer.eos_token_id in ids
            else len(ids)
        )
        margin = min(hf_greedy.margin(model, prompt_ids, step) for step in range(num_ids))
        full_text = self.tokenizer.decode(ids[:num_ids], skip_special_tokens=True)
        text = full_text
        for stop in UNTIL:
            text = text.split(stop)[0]
        return text, text != full_text, margin


def args_of(sample: dict) -> list[tuple[str, str]]:
    """(context, continuation-or-gen-kwargs) of each request lm-eval made for a sample."""
    return [(context, other) for context, other in sample["arguments"]]


@pytest.mark.parametrize("tokenized_requests", [True, False], ids=["token-ids", "text"])
def test_lm_eval_local_completions_scores_as_transformers(
    tokenized_requests: bool,
    model_dir: Any,
    request: pytest.FixtureRequest,
    tasks_dir: Path,
    hf_greedy: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = model_dir("llama") if tokenized_requests else request.getfixturevalue("no_bos_model")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    flags = ["--served-model-name", "tiny-llama", "--no-engine-process"]
    with loopback_only(), http_server(model, *flags) as server:
        results = evaluate(server.base_url, model, tasks_dir, tokenized_requests)
        server.assert_nothing_left()
    oracle = Oracle(model)

    choice_samples = sorted(results["samples"]["ae_choice"], key=lambda s: s["doc_id"])
    assert [s["doc"] for s in choice_samples] == CHOICE_ITEMS
    num_right = 0
    for sample in choice_samples:
        (got,) = zip(*sample["resps"])  # one (loglikelihood, is_greedy) per choice
        expected = [oracle.loglikelihood(ctx, cont) for ctx, cont in args_of(sample)]
        if not tokenized_requests:  # the text lm-eval sends tokenizes back to its own split
            for ctx, cont in args_of(sample):
                whole = oracle.encode(ctx + cont)
                assert oracle.encode(oracle.tokenizer.decode(whole)) == whole
        for (ll, is_greedy), (want_ll, want_greedy) in zip(got, expected, strict=True):
            assert abs(ll - want_ll) < TOLERANCE, (sample["doc"], ll, want_ll)
            assert is_greedy == want_greedy, sample["doc"]
        lls = [want_ll for want_ll, _ in expected]
        num_right += lls.index(max(lls)) == sample["doc"]["answer"]
    assert results["results"]["ae_choice"]["acc,none"] == pytest.approx(
        num_right / len(CHOICE_ITEMS)
    )

    until_samples = sorted(results["samples"]["ae_until"], key=lambda s: s["doc_id"])
    assert [s["doc"] for s in until_samples] == UNTIL_ITEMS
    num_checked = num_stopped = 0
    for sample in until_samples:
        ((context, gen_kwargs),) = args_of(sample)
        assert gen_kwargs["until"] == UNTIL and gen_kwargs["max_gen_toks"] == MAX_GEN_TOKS
        want, is_stopped, margin = oracle.generate(hf_greedy, model, context)
        if margin < 1e-3:
            continue
        assert sample["resps"] == [[want]], (context, margin)
        num_checked += 1
        num_stopped += is_stopped
    assert num_checked >= len(UNTIL_ITEMS) - 1
    assert num_stopped, "no generation reached a stop string: pick another UNTIL"
