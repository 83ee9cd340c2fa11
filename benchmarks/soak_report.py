"""What soak.py prints: its tables, the goals of issue 24 and which of them failed.

The goals that are correctness properties (no leaked block, no stuck slot, no stream CANCELLED
that its caller did not cancel, no admitted count past its limit) fail the run; the latency and
memory goals (the canary's gaps, RSS flat by the last rounds) are reported, met or not.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

# the ways a soak stream ends (soak.py plans them; the tables list them in this order)
ENDINGS = ("complete", "cancel", "deadline", "close", "sigkill")
GAP_GOAL_MS = 100.0  # issue 24: the canary's worst gap within 100 ms of its normal gap
MEASURES = (("", "streams"), ("after_big_bodies", "big bodies"), ("after_burst", "burst"))


def measured_rows(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every measure of what the server holds: after each phase of each round, and at the end."""
    rows = []
    for row in report.get("rounds", []):
        for key, phase in MEASURES:
            if not key or key in row:
                rows.append((f"round {row['round']} after {phase}", row[key] if key else row))
    if "after_hostile" in report:
        rows.append(("after hostile", report["after_hostile"]))
    return rows


def unasked_cancels(report: dict[str, Any]) -> dict[str, int]:
    """CANCELLED that no caller asked for: burst streams, canaries, streams meant to complete."""
    counts: Counter[str] = Counter()
    for row in report.get("rounds", []):
        counts["complete streams"] += row["statuses"].get("complete", {}).get("CANCELLED", 0)
        if "burst" in row:
            counts["burst streams"] += row["burst"]["cancelled"]
            counts["burst canary"] += row["burst"]["canary_errors"].get("CANCELLED", 0)
    if "hostile" in report:
        counts["hostile canary"] += report["hostile"]["canary_errors"].get("CANCELLED", 0)
    return dict(counts)


def failures(report: dict[str, Any]) -> list[str]:
    """Leaked blocks, stuck slots, an engine never idle, unasked-for CANCELLED, a burst stream
    ended by anything but OK / RESOURCE_EXHAUSTED / CANCELLED, an admitted count past its limit."""
    found = []
    for name, row in measured_rows(report):
        for key in ("leaked_gpu_blocks", "leaked_cpu_blocks", "admitted", "stuck_slots"):
            if row[key]:
                found.append(f"{name}: {key} = {row[key]}")
        if not row["idle"]:
            found.append(f"{name}: the engine never went idle")
    found += [f"{where}: {n} CANCELLED" for where, n in unasked_cancels(report).items() if n]
    for row in report.get("rounds", []):
        burst = row.get("burst")
        if burst and (burst["other"] or burst["num_over_limit"]):
            found.append(f"round {row['round']} burst: other {burst['other']}, "
                         f"{burst['num_over_limit']} refusals over the limit")  # fmt: skip
    return found


def rss_per_round(report: dict[str, Any]) -> list[float]:
    """The server's RSS at the end of each round (after its last phase)."""
    out = []
    for row in report.get("rounds", []):
        last = row.get("after_burst") or row.get("after_big_bodies") or row
        out.append(last["rss_mib"])
    return out


def worst_excess(report: dict[str, Any]) -> tuple[float, str]:
    """The largest canary gap beyond normal over every big body of every round, and where."""
    worst, where = float("-inf"), "-"
    for row in report.get("rounds", []):
        for name, body in row.get("big_bodies", {}).items():
            if body["canary_excess_ms"] > worst:
                worst, where = body["canary_excess_ms"], f"{name}, round {row['round']}"
    return worst, where


def goals(report: dict[str, Any], ns: argparse.Namespace) -> list[dict[str, Any]]:
    """Issue 24's goals, each with what was measured and whether it was met."""
    out = []

    def add(goal: str, result: str, is_met: bool) -> None:
        out.append({"goal": goal, "result": result, "met": is_met})

    rounds = report.get("rounds", [])
    if any("big_bodies" in r for r in rounds):
        worst, where = worst_excess(report)
        add("big bodies: canary worst gap beyond normal < 100 ms", f"{worst:+.1f} ms ({where})",
            worst < GAP_GOAL_MS)  # fmt: skip
    bursts = [r["burst"] for r in rounds if "burst" in r]
    if bursts:
        worst = max(b["canary_excess_ms"] for b in bursts)
        add("burst: canary worst gap within a stream beyond normal < 100 ms",
            f"{worst:+.1f} ms", worst < GAP_GOAL_MS)  # fmt: skip
        num_over = sum(b["num_over_limit"] for b in bursts)
        add("burst: refusals reporting an admitted count over the limit = 0", str(num_over),
            num_over == 0)  # fmt: skip
    if "hostile" in report:
        worst = max(r["canary_excess_ms"] for r in report["hostile"]["requests"].values())
        add("hostile requests: canary worst gap beyond normal < 100 ms", f"{worst:+.1f} ms",
            worst < GAP_GOAL_MS)  # fmt: skip
    cancels = unasked_cancels(report)
    add(
        "CANCELLED nobody asked for = 0",
        ", ".join(f"{k} {v}" for k, v in cancels.items()) or "-",
        not any(cancels.values()),
    )
    rows = [row for _, row in measured_rows(report)]
    num_leaked = max((r["leaked_gpu_blocks"] + r["leaked_cpu_blocks"] for r in rows), default=0)
    add("leaked KV blocks = 0 (worst measure)", str(num_leaked), num_leaked == 0)
    num_stuck = max((r["stuck_slots"] + r["admitted"] for r in rows), default=0)
    add("stuck admission slots = 0 (worst measure)", str(num_stuck), num_stuck == 0)
    rss = rss_per_round(report)
    if len(rss) >= 5:
        spread = max(rss[-5:]) - min(rss[-5:])
        add(f"RSS flat over the last 5 rounds (spread <= {ns.rss_noise_mib:g} MiB)",
            f"spread {spread:.1f} MiB; per round " + ", ".join(f"{x:.0f}" for x in rss),
            spread <= ns.rss_noise_mib)  # fmt: skip
    return out


def print_cells(cells: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def held(row: dict[str, Any] | None) -> str:
    """Leaked blocks / stuck slots of one measure, as `leaked/stuck`."""
    if row is None:
        return ""
    leaked = row["leaked_gpu_blocks"] + row["leaked_cpu_blocks"]
    return f"{leaked}/{row['stuck_slots'] + row['admitted']}"


def print_phases(report: dict[str, Any]) -> None:
    """Per round: the big bodies' worst canary gap, the burst, what was held after each, RSS."""
    if not any("big_bodies" in row or "burst" in row for row in report["rounds"]):
        return
    print("\nbig bodies and burst, per round (gaps in ms beyond the canary's normal gap; "
          "held = leaked blocks/stuck slots)")  # fmt: skip
    cells = [["round", "bodies worst", "held", "burst OK", "RES_EXH", "CANCELLED", "other",
              "over limit", "canary +ms (when)", "canary errors", "held", "RSS MiB"]]  # fmt: skip
    for row in report["rounds"]:
        bodies = row.get("big_bodies", {})
        worst = max(bodies.items(), key=lambda kv: kv[1]["canary_excess_ms"], default=None)
        burst = row.get("burst", {})
        cells.append([str(c) for c in (
            row["round"], f"{worst[1]['canary_excess_ms']:+.0f} ({worst[0]})" if worst else "",
            held(row.get("after_big_bodies")), burst.get("ok", ""),
            burst.get("resource_exhausted", ""), burst.get("cancelled", ""),
            sum(burst.get("other", {}).values()) if burst else "", burst.get("num_over_limit", ""),
            f"{burst['canary_excess_ms']:+.0f} at {burst.get('canary_worst_gap_at_s', '?')} s"
            if burst else "",
            dict(burst.get("canary_errors", {})) or "-", held(row.get("after_burst")),
            rss_per_round({"rounds": [row]})[0],
        )])  # fmt: skip
    print_cells(cells)


def print_bodies(report: dict[str, Any]) -> None:
    """Per big body, over the rounds: its statuses and the canary's gap beyond normal."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for row in report["rounds"]:
        for name, body in row.get("big_bodies", {}).items():
            by_name.setdefault(name, []).append(body)
    if not by_name:
        return
    print("\ncanary gap beyond normal per big body, over the rounds (ms)")
    cells = [["body", "status", "took s (median)", "median", "worst", "rounds >= 100"]]
    for name, bodies in by_name.items():
        excess = [b["canary_excess_ms"] for b in bodies]
        cells.append([name, ",".join(sorted({str(b["status"]) for b in bodies})),
                      f"{statistics.median(b['took_s'] for b in bodies):.2f}",
                      f"{statistics.median(excess):+.1f}", f"{max(excess):+.1f}",
                      f"{sum(x >= GAP_GOAL_MS for x in excess)}/{len(excess)}"])  # fmt: skip
    print_cells(cells)


def print_goals(report: dict[str, Any]) -> None:
    print("\ngoals (issue 24)")
    cells = [["goal", "measured", "met"]]
    cells += [[g["goal"], g["result"], "yes" if g["met"] else "NO"] for g in report["goals"]]
    widths = [max(len(r[i]) for r in cells) for i in range(3)]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def print_rounds(report: dict[str, Any], ns: argparse.Namespace) -> None:
    head = ["round", "streams", "wall s", "idle", "leaked gpu", "leaked cpu", "admitted",
            "peak admitted", "stuck (probe)", "RSS MiB", "peak RSS", "stall seen",
            "stall ended"]  # fmt: skip
    table = [head]
    hostile = report.get("after_hostile")
    after = [{**hostile, "round": "after hostile"}] if hostile else []
    for row in [*report["rounds"], *after]:
        table.append([str(c) for c in (
            row["round"], row.get("streams", ""), row.get("wall_s", ""), row["idle"],
            row["leaked_gpu_blocks"], row["leaked_cpu_blocks"], row["admitted"],
            row.get("peak_admitted", ""), f"{row['stuck_slots']}/{row['slots']}", row["rss_mib"],
            row["peak_rss_mib"], *([f"{row['stalled_seen']}/{ns.stalled}",
            f"{row['stalled_ended']}/{ns.stalled}"] if "stalled" in row else ["", ""]),
        )])  # fmt: skip
    print_cells(table)


def print_streams(report: dict[str, Any]) -> None:
    print("\nstatus the client saw, per way of ending (all rounds)")
    totals: dict[str, Counter[str]] = {e: Counter() for e in ENDINGS}
    for row in report["rounds"]:
        for ending, counts in row["statuses"].items():
            totals[ending].update(counts)
    for ending, counts in totals.items():
        print(f"  {ending:>9}: " + ", ".join(f"{s} {n}" for s, n in counts.most_common()))
    print("\nstalled readers: the status each had at the end of the wait; then, reading again")
    for row in report["rounds"]:
        groups: dict[tuple[str, str], list[int]] = {}
        for entry in row["stalled"]:
            status = entry["status"]
            if "after_s" in entry:
                status += f" after {entry['after_s']} s of stall"
            key = (status, entry.get("on_reading_again", "-"))
            groups.setdefault(key, []).append(entry.get("messages_then", 0))
        parts = [f"{status} x{len(counts)}, then {again} after {min(counts)}-{max(counts)} msgs"
                 for (status, again), counts in groups.items()]  # fmt: skip
        print(f"  round {row['round']}: " + "; ".join(parts))


def print_hostile(report: dict[str, Any]) -> None:
    hostile = report.get("hostile")
    if hostile is None:  # --no-hostile
        return
    errors = f", errors {hostile['canary_errors']}" if hostile["canary_errors"] else ""
    print(
        f"\ncanary: {hostile['canary_messages']} messages, normal gap p50 "
        f"{hostile['canary_gap_p50_ms']} ms (max {hostile['canary_gap_max_normal_ms']} ms){errors}"
    )
    for result in hostile["requests"].values():
        goal = "met" if result["canary_excess_ms"] < 100 else "MISSED"
        print(
            f"  {result['what']:>22}: {result['status']} in {result['latency_ms']} ms; "
            f"canary worst gap {result['canary_worst_gap_ms']} ms "
            f"(+{result['canary_excess_ms']} ms beyond normal, goal < 100: {goal})"
        )


def print_report(report: dict[str, Any], ns: argparse.Namespace) -> None:
    mode = "fake runner" if ns.fake_runner else "tiny model" if ns.model is None else ns.model
    if Path(mode).name == "default_model":
        mode = "bundled default model"
    stall = (
        f"--stall-timeout {ns.stall_timeout:g}" if report["has_stall_timeout"] else "no stall flag"
    )
    print(
        f"asyncengine serve ({mode}), {ns.max_num_seqs} running + {ns.max_queued_requests} "
        f"queued, {stall}; {ns.rounds} rounds of {ns.streams} streams + {ns.stalled} stalled, "
        f"then {len(ns.big_bodies.split(',')) if ns.big_bodies else 0} big bodies and a burst "
        f"of {ns.burst_streams} streams"
    )
    print_rounds(report, ns)
    print_streams(report)
    print_phases(report)
    print_bodies(report)
    print_hostile(report)
    log = report["server_log"]
    print(f"\nserver exit code {report['server_exit_code']}; log levels {log['levels']}")
    print(f"  finish reasons logged: {log['finish_reasons']}")
    if log["warnings"]:
        print(f"  warnings/errors: {log['warnings']}")
    print_goals(report)
    found = report["failures"]
    ok = "OK: no leaked blocks, no stuck slots, no CANCELLED that nobody asked for"
    print("\n" + ("FAIL: " + "; ".join(found) if found else ok))
