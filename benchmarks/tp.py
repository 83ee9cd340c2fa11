"""Tensor parallelism on this machine: tokens/s, memory per rank and the plan broadcast's cost.

For each N in --sizes (default 1 2), a fresh process builds `LLM(tensor_parallel_size=N)` on a
random Llama (CPU, gloo), warms up, then generates the same greedy requests. Per N it reports:

- tokens/s of the timed run (output tokens / wall time);
- per rank: the weights it holds, its KV cache, and its peak RSS (VmHWM) after loading and at
  the end (each rank reads only its slices of the checkpoint, so the weights' part of the
  load-time peak is about 1/N);
- the driver's broadcast per step: the time and bytes of announcing each forward (block moves,
  inputs and attention metadata) and each logits gather's rows to the workers. The time
  includes any wait for a worker to reach its receive, so it is an upper bound of the cost;
- the forward's own collectives per step (two all_reduces per layer, one for the embedding,
  the logits gather), timed on the driver, waits for the other rank included.

On a machine with few cores, N=2 is slower than N=1: the ranks share the same cores, and each
layer adds two all_reduces. Tensor parallelism pays where each rank has a device of its own.

    python benchmarks/tp.py [--hidden 1024 --layers 8] [--num-requests 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def peak_rss_mib(pid: int | str = "self") -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MiB, from /proc."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


class BroadcastTimer:
    """Wraps the driver's channel: seconds per kind of message, and every broadcast's bytes."""

    def __init__(self, channel: Any) -> None:
        self.originals = {
            name: getattr(channel, name)
            for name in ("send_step", "send_logits", "_broadcast_ints", "_broadcast_device")
        }
        self.reset()
        for name in ("send_step", "send_logits"):
            setattr(channel, name, self._timed(name))
        for name in ("_broadcast_ints", "_broadcast_device"):
            setattr(channel, name, self._counted(name))

    def reset(self) -> None:
        self.seconds = {"send_step": 0.0, "send_logits": 0.0}
        self.num_calls = {"send_step": 0, "send_logits": 0}
        self.num_bytes = 0
        self.num_broadcasts = 0

    def _timed(self, name: str) -> Any:
        original = self.originals[name]

        def timed(*args: Any) -> None:
            started = time.perf_counter()
            original(*args)
            self.seconds[name] += time.perf_counter() - started
            self.num_calls[name] += 1

        return timed

    def _counted(self, name: str) -> Any:
        original = self.originals[name]

        def counted(tensor: torch.Tensor) -> None:
            self.num_bytes += tensor.numel() * tensor.element_size()
            self.num_broadcasts += 1
            original(tensor)

        return counted


class CollectiveTimer:
    """Times the forward's collectives on the driver (all_reduce, the logits gather): their
    own cost plus any wait for the slower rank."""

    def __init__(self) -> None:
        from asyncengine.distributed.parallel_state import TensorParallelGroup

        self.seconds = 0.0
        self.num_calls = 0
        for name in ("all_reduce", "gather_to_driver"):
            setattr(TensorParallelGroup, name, self._timed(getattr(TensorParallelGroup, name)))

    def _timed(self, method: Any) -> Any:
        def timed(group: Any, tensor: torch.Tensor) -> torch.Tensor:
            started = time.perf_counter()
            out = method(group, tensor)
            self.seconds += time.perf_counter() - started
            self.num_calls += 1
            return out

        return timed


def run_one(ns: argparse.Namespace) -> dict[str, Any]:
    """One N, in this process (the parent runs each N in a fresh one)."""
    from asyncengine import LLM, SamplingParams
    from asyncengine.logging import configure_logging

    configure_logging("WARNING")
    torch.set_num_threads(ns.threads)
    llm = LLM(
        model=ns.model, dtype="float32", device="cpu", max_num_seqs=ns.num_requests,
        tensor_parallel_size=ns.one, enable_prefix_caching=False,
    )  # fmt: skip
    executor: Any = llm.llm_engine.model_runner
    runner = executor if ns.one == 1 else executor.runner
    pids = [] if ns.one == 1 else executor.worker_pids
    at_load = [peak_rss_mib()[1], *(peak_rss_mib(pid)[1] for pid in pids)]
    timer = BroadcastTimer(executor.channel) if ns.one > 1 else None
    collectives = CollectiveTimer() if ns.one > 1 else None
    prompts = [[(7 * i + 13 * j) % 2000 + 3 for j in range(ns.prompt_len)] for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    llm.generate(prompts[-4:], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    if timer is not None and collectives is not None:  # count the timed run only
        timer.reset()
        collectives.seconds, collectives.num_calls = 0.0, 0
    started = time.perf_counter()
    outs = llm.generate(prompts[: ns.num_requests], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num_tokens == ns.num_requests * ns.output_len
    at_end = [peak_rss_mib()[1], *(peak_rss_mib(pid)[1] for pid in pids)]
    weights = runner._weights_bytes()  # parameters and buffers (CPU linears pack into buffers)
    kv = runner.bytes_per_block() * llm.get_stats().num_gpu_blocks
    result: dict[str, Any] = {
        "tensor_parallel_size": ns.one,
        "tokens_per_s": round(num_tokens / seconds, 1),
        "seconds": round(seconds, 2),
        "weights_mib_per_rank": round(weights / 2**20, 1),
        "kv_cache_mib_per_rank": round(kv / 2**20, 1),
        "peak_rss_mib_after_load": [round(m) for m in at_load],
        "peak_rss_mib_at_end": [round(m) for m in at_end],
    }
    if timer is not None and collectives is not None:
        steps = max(timer.num_calls["send_step"], 1)
        result["collectives_per_step"] = round(collectives.num_calls / steps, 1)
        result["collectives_ms_per_step"] = round(1e3 * collectives.seconds / steps, 2)
        result["steps"] = timer.num_calls["send_step"]
        result["step_ms"] = round(1e3 * seconds / steps, 2)
        result["broadcast_us_per_step"] = round(1e6 * sum(timer.seconds.values()) / steps, 1)
        result["broadcast_us_per_step_by_kind"] = {
            name.removeprefix("send_"): round(1e6 * value / steps, 1)
            for name, value in timer.seconds.items()
        }
        result["broadcasts_per_step"] = round(timer.num_broadcasts / steps, 2)
        result["broadcast_bytes_per_step"] = round(timer.num_bytes / steps)
    llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory (default: a random Llama)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.one is not None:
        print(json.dumps(run_one(ns)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if ns.model is None:
            from asyncengine.testing import make_sized_llama

            ns.model = str(make_sized_llama(Path(tmp) / "model", ns.hidden, ns.layers))
        rows = []
        for size in ns.sizes:
            args = [a for a in sys.argv[1:] if a != "--json"]
            command = [sys.executable, __file__, *args, "--model", ns.model, "--one", str(size)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"N={size} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr)
    config = {k: v for k, v in vars(ns).items() if k not in ("json", "one")}
    if ns.json:
        print(json.dumps({"config": config, "results": rows}, indent=2))
        return
    print(f"model: hidden {ns.hidden}, {ns.layers} layers, float32, CPU, {ns.threads} thread/rank")
    columns = [("N", "tensor_parallel_size"), ("tok/s", "tokens_per_s"), ("step ms", "step_ms"),
               ("weights MiB/rank", "weights_mib_per_rank"),
               ("KV MiB/rank", "kv_cache_mib_per_rank"),
               ("peak RSS MiB after load", "peak_rss_mib_after_load"),
               ("collectives ms/step", "collectives_ms_per_step"),
               ("broadcast us/step", "broadcast_us_per_step"),
               ("broadcasts/step", "broadcasts_per_step"),
               ("bytes/step", "broadcast_bytes_per_step")]  # fmt: skip
    print(" | ".join(title for title, _ in columns))
    for row in rows:
        cells = [row.get(key, "-") for _, key in columns]
        print(" | ".join(", ".join(map(str, c)) if isinstance(c, list) else str(c) for c in cells))


if __name__ == "__main__":
    main()
