"""The `asyncengine` command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from asyncengine.config import EngineArgs
from asyncengine.logging import configure_logging


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per EngineArgs field, named as in vLLM (`--max-num-seqs`, ...)."""
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is dataclasses.MISSING else f.default
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
            continue
        kind: Any = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
        parser.add_argument(flag, type=kind, default=default, required=f.name == "model")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def _generate(ns: argparse.Namespace) -> int:
    from asyncengine import LLM, SamplingParams

    args = engine_args_from(ns)
    llm = LLM(**dataclasses.asdict(args))
    params = SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, seed=ns.seed_sample
    )
    for out in llm.generate(ns.prompts, params, use_tqdm=False):
        if out.error:
            print(f"error: {out.error}", file=sys.stderr)
            continue
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncengine", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline for a few prompts and print them")
    add_engine_args(gen)
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed-sample", type=int, default=None, help="per-request sampling seed")
    ns = parser.parse_args(argv)
    configure_logging(ns.log_level)
    try:
        return _generate(ns)
    except ValueError as exc:
        parser.exit(2, f"asyncengine: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
