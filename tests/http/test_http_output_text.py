"""A streamed completion's text is its output tokens' text, for prompts of random token ids
(as vLLM's benchmark, lm-eval or a gateway send them): the SSE deltas joined equal
`decode` of transformers' greedy tokens for the prompt."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from serving_http import ServerThread
from transformers import AutoTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_PROMPTS, MAX_TOKENS = 12, 16


def test_streamed_text_of_random_token_prompts_is_the_outputs_decode(
    server: ServerThread, chat_model: Path, hf_greedy
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    rng = random.Random(25)
    prompts = [
        [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(4, 40))]
        for _ in range(NUM_PROMPTS)
    ]
    client = server.client()
    num_checked = 0
    for ids in prompts:
        expected = hf_greedy(chat_model, ids, MAX_TOKENS)
        if min(hf_greedy.margin(chat_model, ids, step) for step in range(MAX_TOKENS)) < 1e-3:
            continue  # a near tie: the engine may pick the other token, and rightly
        stream = client.completions.create(
            model=server.model,
            prompt=ids,
            max_tokens=MAX_TOKENS,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text == tokenizer.decode(expected, skip_special_tokens=True), ids
        num_checked += 1
    assert num_checked >= NUM_PROMPTS // 2
