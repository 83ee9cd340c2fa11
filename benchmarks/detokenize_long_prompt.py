"""What a prompt's length costs a sample's detokenizer: the time to make it and decode the first
output token, then each of the next ones, for prompts of random token ids up to 1M tokens.

The detokenizer decodes only the output (after one context token), so the cost stays flat; a
`DecodeStream` seeded with the whole prompt (this engine before issue 25) grew with it, ~1 s at
the first token of a 1M-token prompt.

    python benchmarks/detokenize_long_prompt.py [--model DIR] [--lengths 1000 1000000] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from typing import Any

from transformers import AutoTokenizer

from asyncengine.engine.detokenizer import make_detokenizer
from asyncengine.testing import train_bpe_tokenizer

NUM_OUTPUT_TOKENS = 16


def measure(tokenizer: Any, num_prompt_tokens: int) -> dict[str, float]:
    rng = random.Random(0)
    vocab = len(tokenizer)
    token_ids = [rng.randrange(3, vocab) for _ in range(num_prompt_tokens + NUM_OUTPUT_TOKENS)]
    prompt, seq = token_ids[:num_prompt_tokens], token_ids[: num_prompt_tokens + 1]
    new_detokenizer = make_detokenizer(tokenizer)
    started = time.perf_counter()
    detokenizer = new_detokenizer(prompt, True)
    detokenizer.decode_next(seq)
    first_s = time.perf_counter() - started
    started = time.perf_counter()
    for token_id in token_ids[num_prompt_tokens + 1 :]:
        seq.append(token_id)
        detokenizer.decode_next(seq)
    next_s = (time.perf_counter() - started) / (NUM_OUTPUT_TOKENS - 1)
    return {
        "num_prompt_tokens": num_prompt_tokens,
        "first_ms": first_s * 1e3,
        "next_us": next_s * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="a model or tokenizer directory (default: the tests' tokenizer)"
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 100_000, 1_000_000])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        tokenizer = train_bpe_tokenizer(tempfile.mkdtemp(prefix="detok-"))
    rows = [measure(tokenizer, n) for n in args.lengths]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'prompt tokens':>14} {'first token ms':>15} {'next token us':>14}")
    for row in rows:
        print(f"{row['num_prompt_tokens']:>14} {row['first_ms']:>15.2f} {row['next_us']:>14.1f}")


if __name__ == "__main__":
    main()
