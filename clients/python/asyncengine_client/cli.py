"""The `asyncengine-client` command line: generate, info, health, tokenize against a server."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from asyncengine_client.errors import AsyncEngineError
from asyncengine_client.options import DEFAULT_TARGET, Tls
from asyncengine_client.results import Delta, Finished, Usage
from asyncengine_client.sync import Client


def _header(ns: argparse.Namespace, index: int) -> None:
    """With several prompts, head each one's completion as `head` does several files."""
    if len(ns.prompts) < 2:
        return
    prompt = ns.prompts[index]
    shown = repr(prompt if len(prompt) <= 60 else prompt[:57] + "...")
    if index:
        print()  # a blank line between completions
    print(f"==> prompt {index + 1}: {shown} <==", flush=True)


def _generate(client: Client, ns: argparse.Namespace) -> int:
    options: dict[str, Any] = {
        "max_new_tokens": ns.max_new_tokens,
        "temperature": ns.temperature,
        "top_p": ns.top_p,
        "top_k": ns.top_k,
        "seed": ns.seed,
        "stop": ns.stop,
        "ignore_eos": ns.ignore_eos,
    }
    if not ns.stream:
        for index, completion in enumerate(client.generate(ns.prompts, **options)):
            _header(ns, index)
            print(completion.text)
            print(f"[{completion.finish_reason.value}]", file=sys.stderr)
        return 0
    for index, prompt in enumerate(ns.prompts):
        _header(ns, index)
        for event in client.generate_stream(prompt, **options):
            if isinstance(event, Delta):
                print(event.text, end="", flush=True)
            elif isinstance(event, Finished):
                print()
                print(f"[{event.reason.value}]", end=" ", file=sys.stderr)
            elif isinstance(event, Usage):
                print(
                    f"prompt {event.prompt_tokens} + completion {event.completion_tokens} tokens",
                    file=sys.stderr,
                )
    return 0


def _info(client: Client, ns: argparse.Namespace) -> int:
    info = {
        "model": dataclasses.asdict(client.model_info()),
        "server": dataclasses.asdict(client.server_info()),
    }
    print(json.dumps(info, indent=2))
    return 0


def _health(client: Client, ns: argparse.Namespace) -> int:
    status = client.health(ns.service)
    print(status)
    return 0 if status == "SERVING" else 1


def _tokenize(client: Client, ns: argparse.Namespace) -> int:
    (result,) = client.tokenize([ns.text], return_tokens=True)
    print(json.dumps({"token_ids": result.token_ids, "tokens": result.tokens}, ensure_ascii=False))
    return 0


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default=DEFAULT_TARGET, help="host:port or a gRPC target URI")
    common.add_argument("--token", help="bearer token")
    common.add_argument("--tls-ca", help="PEM root certificate: use TLS")
    common.add_argument("--tls-cert", help="PEM client certificate (mTLS, with --tls-key)")
    common.add_argument("--tls-key", help="PEM client key")
    common.add_argument("--timeout", type=float, help="seconds per command")

    parser = argparse.ArgumentParser(prog="asyncengine-client", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", parents=[common], help="generate for prompts")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--stream", action="store_true", help="print tokens as they come")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(run=_generate)
    sub.add_parser("info", parents=[common], help="model and server info").set_defaults(run=_info)
    health = sub.add_parser("health", parents=[common], help="exit 0 when SERVING")
    health.add_argument("--service", default="", help='grpc.health.v1 service ("": the server)')
    health.set_defaults(run=_health)
    tok = sub.add_parser("tokenize", parents=[common], help="token ids of a text")
    tok.add_argument("text")
    tok.set_defaults(run=_tokenize)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    tls = None
    if ns.tls_ca or ns.tls_cert:
        tls = Tls.from_files(ns.tls_ca, ns.tls_cert, ns.tls_key)
    try:
        with Client(ns.target, token=ns.token, tls=tls, timeout=ns.timeout) as client:
            return int(ns.run(client, ns))
    except AsyncEngineError as exc:
        print(f"asyncengine-client: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the stream is cancelled with the channel
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
