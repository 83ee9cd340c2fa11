"""The `asyncengine` command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING

from asyncengine.errors import KVCacheSizingError
from asyncengine.logging import configure_logging, default_log_level
from asyncengine.server.engine_flags import add_engine_args, engine_args_from
from asyncengine.server.serve_flags import OBSERVABILITY, add_serve_args

if TYPE_CHECKING:
    from asyncengine.server.app import EngineFactory


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


def _serve(ns: argparse.Namespace, make_engine: EngineFactory | None) -> int:
    from asyncengine.server.app import run
    from asyncengine.server.options import serve_options_from

    return run(engine_args_from(ns), serve_options_from(ns), make_engine)


SERVE_DESCRIPTION = (
    "Serve the model over gRPC (Generation, Control, health, reflection) and, with --http-port, "
    "over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models), "
    "both on one engine, until SIGTERM/SIGINT, which drains in-flight requests and exits 0; "
    "exits non-zero if the engine dies. Logs are JSON lines on stderr. The first start on a "
    "machine compiles the C++ CPU ops (about a minute on 2 cores; the log says so); later "
    "starts load the cached build."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncengine", description=__doc__)
    log_level_help = (
        "DEBUG, INFO, WARNING or ERROR (default: $ASYNCENGINE_LOG_LEVEL, else INFO for serve "
        "and WARNING otherwise)"
    )
    parser.add_argument("--log-level", default=None, help=log_level_help)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline for a few prompts and print them")
    add_engine_args(gen)
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed-sample", type=int, default=None, help="per-request sampling seed")
    # accepted after the subcommand too; SUPPRESS keeps a value given before it
    gen.add_argument("--log-level", default=argparse.SUPPRESS, help=log_level_help)
    serve = sub.add_parser(
        "serve",
        help="serve the model over gRPC and, with --http-port, OpenAI's HTTP API",
        usage="%(prog)s [options]",
        description=SERVE_DESCRIPTION,
    )
    groups = add_serve_args(serve)
    groups[OBSERVABILITY.title].add_argument(
        "--log-level", default=argparse.SUPPRESS, help=log_level_help
    )
    add_engine_args(serve)
    worker = sub.add_parser(
        "worker",
        help="run one node's tensor-parallel ranks for an engine on another node",
        description="Start this node's ranks of a tensor-parallel engine whose leader (node 0) "
        "runs `asyncengine serve`, and wait for them: exits 0 when the leader shuts them down, "
        "1 when a rank fails. Give the same engine flags as the leader, plus --node-rank.",
    )
    worker.add_argument("--node-rank", type=int, required=True, help="this node: 1..num_nodes-1")
    add_engine_args(worker)
    worker.add_argument("--log-level", default=argparse.SUPPRESS, help=log_level_help)
    return parser


def _worker(ns: argparse.Namespace) -> int:
    from asyncengine.distributed.worker import run_node

    return run_node(engine_args_from(ns).create_engine_config(), ns.node_rank)


def main(argv: list[str] | None = None, make_engine: EngineFactory | None = None) -> int:
    """The `asyncengine` command; `make_engine` builds the served engine instead of
    `AsyncLLMEngine.from_engine_args` (`python -m asyncengine.testing serve` uses it)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    default = "WARNING" if ns.command == "generate" else "INFO"
    configure_logging(ns.log_level or default_log_level(default))
    try:
        if ns.command == "worker":
            return _worker(ns)
        return _serve(ns, make_engine) if ns.command == "serve" else _generate(ns)
    except (ValueError, OSError, KVCacheSizingError) as exc:
        parser.exit(2, f"asyncengine: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
