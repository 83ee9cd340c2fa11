"""guidellm against `asyncengine serve --http-port`: a short run of vLLM's own load generator.

Starts the server as a subprocess on loopback (ports 0, read from its 'http_serving' log line),
then runs `guidellm run` once per profile (synchronous: one request at a time; concurrent: N
streams; constant: a fixed request rate) over /v1/completions with streaming, each for
--requests requests of synthetic text (--prompt-tokens in, --output-tokens out, made with the
served model's own tokenizer, so nothing is downloaded). It reports guidellm's numbers: requests
done and errored, requests/s, output tokens/s, TTFT and ITL (p50, p99) and request latency.

    python benchmarks/guidellm.py                          # a small random model, 16 requests
    python benchmarks/guidellm.py --model DIR --profiles synchronous constant --rate 4 --json

Needs the `clients` extra (`pip install -e '.[clients]'`). The exit status is 1 when any request
errored or came back with other than --output-tokens tokens. guidellm shares the machine with the
server, and on a small machine its own start (~10 s) dwarfs a run this short.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

SMALL_MODEL: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
SERVED_NAME = "asyncengine-bench"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


class Server:
    """`asyncengine serve --port 0 --http-port 0` on 127.0.0.1; its log to a file."""

    def __init__(self, model: str, dtype: str, threads: int, log_path: Path) -> None:
        script = shutil.which("asyncengine", path=str(Path(sys.executable).parent))
        command = [script, "serve"] if script else [sys.executable, "-m", "asyncengine.server.cli",
                                                    "serve"]  # fmt: skip
        command += ["--model", model, "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                    "--served-model-name", SERVED_NAME, "--dtype", dtype,
                    "--torch-threads", str(threads)]  # fmt: skip
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **OFFLINE},
        )
        assert self.proc.stderr is not None
        self.http_port = self._read_port(self.proc.stderr)
        # keep draining the log, or a full pipe would stall the server
        self._drain = threading.Thread(target=self._copy, args=(self.proc.stderr,), daemon=True)
        self._drain.start()

    def _read_port(self, stream: IO[str]) -> int:
        for line in stream:
            self._log.write(line)
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == "http_serving":
                return int(event["port"])
        self._log.close()
        raise RuntimeError(f"server exited:\n{self.log_path.read_text()[-3000:]}")

    def _copy(self, stream: IO[str]) -> None:
        for line in stream:
            self._log.write(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)
        self._drain.join(10)
        self._log.close()


def guidellm_run(ns: argparse.Namespace, port: int, model: str, profile: str, out: Path) -> dict:
    """One `guidellm run` of `profile`; its one benchmark from the JSON it writes."""
    kinds = {
        "synchronous": "kind=synchronous",
        "concurrent": f"kind=concurrent,streams={ns.streams}",
        "constant": f"kind=constant,rate={ns.rate}",
    }
    target = f"kind=openai_http,target=http://127.0.0.1:{port},model={SERVED_NAME},"
    target += "request_format=/v1/completions"
    data = f"kind=synthetic_text,prompt_tokens={ns.prompt_tokens},output_tokens={ns.output_tokens}"
    command = [sys.executable, "-m", "guidellm", "run", "--backend", target,
               "--profile", kinds[profile],
               "--constraint", f"kind=max_requests,count={ns.requests}",
               "--data", data, "--tokenizer", f"kind=huggingface_auto,model={model}",
               "--seed", f"kind=static,value={ns.seed}", "--output", f"kind=json,path={out}",
               "--disable-console"]  # fmt: skip
    # cwd: not benchmarks/, where `-m guidellm` would find this file rather than guidellm
    done = subprocess.run(command, cwd=out.parent, env={**os.environ, **OFFLINE},
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"guidellm failed:\n{(done.stdout + done.stderr)[-3000:]}")
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    return benchmark


def summarize(profile: str, benchmark: dict[str, Any]) -> dict[str, Any]:
    metrics = benchmark["metrics"]

    def ok(name: str) -> dict[str, Any]:
        return metrics[name]["successful"]

    totals = metrics["request_totals"]
    return {
        "profile": profile,
        "requests": totals["successful"],
        "errored": totals["errored"] + totals["incomplete"],
        "requests_per_s": round(ok("requests_per_second")["mean"], 2),
        "output_tokens_per_s": round(ok("output_tokens_per_second")["mean"], 1),
        "ttft_p50_ms": round(ok("time_to_first_token_ms")["percentiles"]["p50"], 1),
        "ttft_p99_ms": round(ok("time_to_first_token_ms")["percentiles"]["p99"], 1),
        "itl_p50_ms": round(ok("inter_token_latency_ms")["percentiles"]["p50"], 2),
        "itl_p99_ms": round(ok("inter_token_latency_ms")["percentiles"]["p99"], 2),
        "latency_p50_s": round(ok("request_latency")["percentiles"]["p50"], 3),
        "output_tokens_per_request": ok("output_token_count")["mean"],
        "concurrency_mean": round(ok("request_concurrency")["mean"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model directory (default: a random small Llama)")
    parser.add_argument(
        "--profiles",
        nargs="+",
        choices=["synchronous", "concurrent", "constant"],
        default=["synchronous", "concurrent"],
    )
    parser.add_argument("--requests", type=int, default=16, help="requests per profile")
    parser.add_argument("--streams", type=int, default=4, help="the concurrent profile's")
    parser.add_argument("--rate", type=float, default=8.0, help="the constant profile's, req/s")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto", help="the server's (default: its own pick)")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model
        if model is None:
            from asyncengine.testing import make_random_model

            model = str(make_random_model(Path(tmp) / "model", "llama", vocab_size=4096,
                                          max_position_embeddings=2048, **SMALL_MODEL))  # fmt: skip
        server = Server(model, ns.dtype, ns.threads, Path(tmp) / "server.log")
        try:
            rows = [
                summarize(p, guidellm_run(ns, server.http_port, model, p, Path(tmp) / f"{p}.json"))
                for p in ns.profiles
            ]
        finally:
            server.stop()
    config = {k: v for k, v in vars(ns).items() if k != "json"}
    if ns.json:
        print(json.dumps({"config": config, "results": rows}, indent=2))
    else:
        print(
            f"guidellm -> asyncengine serve --http-port, /v1/completions streamed, "
            f"{ns.prompt_tokens} tokens in, {ns.output_tokens} out, {ns.requests} per profile"
        )
        head = ["profile", "ok", "errored", "req/s", "out tok/s", "TTFT p50", "TTFT p99",
                "ITL p50", "ITL p99", "e2e p50 s", "tok/req"]  # fmt: skip
        keys = ["profile", "requests", "errored", "requests_per_s", "output_tokens_per_s",
                "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "latency_p50_s",
                "output_tokens_per_request"]  # fmt: skip
        print("  ".join(f"{h:>11}" for h in head) + "   (ms)")
        for row in rows:
            print("  ".join(f"{row[k]:>11}" for k in keys))
    bad = [r for r in rows if r["errored"] or r["output_tokens_per_request"] != ns.output_tokens]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
