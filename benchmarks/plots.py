"""The figures of docs/benchmarks.md, drawn from the --json results of the benchmark scripts.

    python benchmarks/serving.py --json > docs/benchmarks/serving.json
    python benchmarks/serving.py --fake-runner --json > docs/benchmarks/serving_fake.json
    python benchmarks/block_size.py --json > docs/benchmarks/block_size.json
    python benchmarks/plots.py [--dir docs/benchmarks]

Writes serving_throughput.png, serving_latency.png and block_size.png next to the results; a
missing result file skips its figure.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt


def load(folder: Path, name: str) -> dict[str, Any] | None:
    """A result file; of serving.py's, the gRPC rows (the figures are gRPC's)."""
    path = folder / name
    if not path.exists():
        return None
    result: dict[str, Any] = json.loads(path.read_text())
    rows = result.get("results")
    if isinstance(rows, list) and rows and "protocol" in rows[0]:
        result["results"] = [r for r in rows if r["protocol"] == "grpc"]
    return result


Result = dict[str, Any]


def serving_throughput(model: Result | None, fake: Result | None, out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    if model:
        rows = grpc_rows(model)
        n = [r["concurrency"] for r in rows]
        tokens = rows[0]["output_tokens"] // rows[0]["requests"]
        axes[0].plot(n, [r["tokens_per_s"] for r in rows], "o-",
                     label=f"output tokens/s ({tokens} per request)")  # fmt: skip
        axes[0].set_title("small model on CPU, through gRPC")
        axes[0].legend(loc="upper left")
    if fake:
        rows = grpc_rows(fake)
        n = [r["concurrency"] for r in rows]
        axes[1].plot(n, [r["in_process_tokens_per_s"] for r in rows], "o-",
                     label="in-process AsyncLLMEngine")  # fmt: skip
        axes[1].plot(n, [r["tokens_per_s"] for r in rows], "s-", label="served over gRPC")
        axes[1].set_title("fake runner: what the loop and the server cost")
        axes[1].legend()
    for ax, result in zip(axes, (model, fake), strict=True):
        concurrency_axis(ax, grpc_rows(result) if result else [])
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def serving_latency(model: dict[str, Any], out: Path) -> None:
    rows = grpc_rows(model)
    n = [r["concurrency"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, title in ((axes[0], "ttft", "time to first token"),
                              (axes[1], "itl", "inter-token latency")):  # fmt: skip
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(n, [r[f"{metric}_{q}_ms"] for r in rows], style, label=q)
        concurrency_axis(ax, rows)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def grpc_rows(result: Result) -> list[dict[str, Any]]:
    """The gRPC rows of a serving.py result (runs before --protocols have no protocol)."""
    return [r for r in result["results"] if r.get("protocol", "grpc") == "grpc"]


def concurrency_axis(ax: Any, rows: list[dict[str, Any]]) -> None:
    ax.set_xscale("log", base=2)
    ticks = [r["concurrency"] for r in rows]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("concurrent streams")
    ax.grid(alpha=0.3, which="both")


def block_size(result: dict[str, Any], out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    waste = result["kv_waste"]
    sizes = [str(w["block_size"]) for w in waste]
    axes[0].bar(sizes, [100 * w["kv_waste"] for w in waste], label="paged, block size B")
    max_len = result["config"]["max_model_len"]
    axes[0].axhline(100 * result["contiguous_kv_waste"], color="tab:red", linestyle="--",
                    label=f"contiguous, {max_len} per request")  # fmt: skip
    axes[0].set_xlabel("block size (tokens)")
    axes[0].set_ylabel("allocated KV slots unused (%)")
    axes[0].set_title("KV waste (model of a mixed workload)")
    axes[0].legend()
    rows = result["throughput"]
    if rows:
        axes[1].plot([str(r["block_size"]) for r in rows], [r["tokens_per_s"] for r in rows], "o-")
        axes[1].set_ylim(bottom=0)
    axes[1].set_xlabel("block size (tokens)")
    axes[1].set_ylabel("output tokens/s")
    axes[1].set_title("throughput, CPU torch attention path")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("docs/benchmarks"))
    ns = parser.parse_args()
    model, fake = load(ns.dir, "serving.json"), load(ns.dir, "serving_fake.json")
    written = []
    if model or fake:
        serving_throughput(model, fake, ns.dir / "serving_throughput.png")
        written.append("serving_throughput.png")
    if model:
        serving_latency(model, ns.dir / "serving_latency.png")
        written.append("serving_latency.png")
    blocks = load(ns.dir, "block_size.json")
    if blocks:
        block_size(blocks, ns.dir / "block_size.png")
        written.append("block_size.png")
    print("wrote", ", ".join(written) or "nothing (no results found)")


if __name__ == "__main__":
    main()
