"""The `asyncengine` command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING, Any

from asyncengine.config import EngineArgs
from asyncengine.errors import KVCacheSizingError
from asyncengine.logging import configure_logging, default_log_level
from asyncengine.server.options import add_serve_args

if TYPE_CHECKING:
    from asyncengine.server.app import EngineFactory

# what each EngineArgs field does, for --help (defaults are printed from EngineArgs itself)
ENGINE_ARG_HELP = {
    "model": "local Hugging Face model directory, or hub id where a network exists (default: "
    "the small model bundled with asyncengine)",
    "tokenizer": "tokenizer directory when it differs from --model",
    "dtype": "weights and KV cache dtype: auto, float32, float16, bfloat16 (auto on a CPU: "
    "bfloat16 where it multiplies bf16 natively, AMX-BF16 or AVX512-BF16, else float32)",
    "device": "auto, cuda or cpu",
    "seed": "seed of the engine's random state, for requests without a seed of their own",
    "block_size": "tokens per KV cache block: a power of two in [8, 1024]",
    "gpu_memory_utilization": "fraction of device memory the model and KV cache may use",
    "swap_space": "GiB of CPU memory for swapped-out KV blocks",
    "num_gpu_blocks_override": "use exactly this many device KV blocks instead of profiling",
    "num_cpu_blocks_override": "use exactly this many CPU swap blocks",
    "max_num_seqs": "most requests running in one step",
    "max_num_batched_tokens": "token budget of one step (default: max(2048, max_num_seqs))",
    "max_model_len": "context length (default: the model's max_position_embeddings)",
    "preemption_mode": "auto, swap or recompute: what happens to a preempted request's KV",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "enable_kv_events": "publish the prefix cache's stored / removed / cleared blocks to "
    "SubscribeKvEvents (SMG's event-driven cache_aware routing) and engine.kv_events() "
    "(default: %(default)s)",
    "attention_backend": "auto, torch or triton",
    "expected_concurrency": "the peak of concurrent requests you expect: a warning at start-up "
    "if max_num_seqs is far from 1.2-1.5x it (default: no check)",
    "max_prompt_bytes": "a text prompt longer than this many UTF-8 bytes is refused before it "
    "is tokenized (default: 32 per token of max_model_len)",
    "grammar_compile_threads": "structured-outputs grammars compile in this many threads at "
    "once (default: one per 4 CPUs, 1 to 4)",
    "max_grammar_compile_s": "a request whose grammar has compiled for this many seconds gets "
    "an error naming its constraint field (default: %(default)s)",
    "max_grammar_cache_bytes": "compiled grammars kept for reuse, the least recently used "
    "evicted past this many bytes; 0: none kept (default: %(default)s)",
    "tensor_parallel_size": "split the model over this many ranks (GPUs, or CPU processes), "
    "Megatron-style over torch.distributed (default: %(default)s)",
    "distributed_init_method": "tensor parallelism's rendezvous, tcp://HOST:PORT on the leader "
    "(needed with --num-nodes > 1; default: a free port on this host)",
    "num_nodes": "nodes the tensor-parallel ranks are split over; node 0 runs the engine, the "
    "others run `asyncengine worker --node-rank K` with the same flags (default: %(default)s)",
    "distributed_timeout_s": "seconds a rank waits for another inside a step before the engine "
    "is declared dead (default: %(default)s)",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per EngineArgs field, named as in vLLM (`--max-num-seqs`, ...)."""
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is dataclasses.MISSING else f.default
        text = ENGINE_ARG_HELP.get(f.name, f.name)
        text += "" if "default" in text else " (default: %(default)s)"
        if f.type in ("bool", bool):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=text
            )
            continue
        kind: Any = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
        parser.add_argument(flag, type=kind, default=default, help=text)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
    if values["model"] is None:  # EngineArgs' own default: the bundled model
        del values["model"]
    return EngineArgs(**values)


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
        help="serve the model over gRPC (Generation, Control, health, reflection)",
        description="Serve the model over gRPC until SIGTERM/SIGINT, which drains in-flight "
        "requests and exits 0; exits non-zero if the engine dies. Logs are JSON lines on "
        "stderr, one per finished request at INFO.",
    )
    add_serve_args(serve)
    add_engine_args(serve)
    serve.add_argument("--log-level", default=argparse.SUPPRESS, help=log_level_help)
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
