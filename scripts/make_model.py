"""Write a small random-weight Hugging Face model and its tokenizer to a directory.

    python scripts/make_model.py /tmp/tiny-llama --family llama
    python scripts/make_model.py /tmp/qwen3 --family qwen3 --hidden-size 256 --layers 4 \\
        --set rope_parameters='{"rope_type": "default", "rope_theta": 10000.0}'

The directory loads with `AutoModelForCausalLM` / `AutoTokenizer` and with the engine.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from asyncengine.testing import FAMILIES, make_random_model

# flag -> Hugging Face config field; unset flags keep make_random_model's per-family defaults
_CONFIG_FLAGS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "max_position_embeddings": "max_position_embeddings",
    "sliding_window": "sliding_window",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out_dir", help="directory to write (created if missing)")
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--intermediate-size", type=int)
    p.add_argument("--layers", type=int, help="num_hidden_layers")
    p.add_argument("--heads", type=int, help="num_attention_heads")
    p.add_argument("--kv-heads", type=int, help="num_key_value_heads")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--max-position-embeddings", type=int)
    p.add_argument("--sliding-window", type=int, help="mistral only")
    p.add_argument(
        "--tie-word-embeddings", action=argparse.BooleanOptionalAction, help="default per family"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="any other config field, value parsed as JSON (bare strings allowed)",
    )
    return p.parse_args(argv)


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields the command line sets, flags first, then each `--set` in order."""
    overrides: dict[str, Any] = {
        field: getattr(args, flag)
        for flag, field in _CONFIG_FLAGS.items()
        if getattr(args, flag) is not None
    }
    if args.tie_word_embeddings is not None:
        overrides["tie_word_embeddings"] = args.tie_word_embeddings
    for item in args.set:
        field, sep, raw = item.partition("=")
        if not sep or not field:
            raise SystemExit(f"--set expects FIELD=JSON, got {item!r}")
        try:
            overrides[field] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[field] = raw
    return overrides


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = make_random_model(
        args.out_dir,
        args.family,
        seed=args.seed,
        dtype=args.dtype,
        vocab_size=args.vocab_size,
        **config_overrides(args),
    )
    print(out)


if __name__ == "__main__":
    main()
