"""docs/operations.md names every limit and timeout `serve` has, with its default (issue 24)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from asyncengine.server.cli import build_parser

OPERATIONS = Path(__file__).parents[2] / "docs" / "operations.md"
# a flag that bounds something (a size, a count, a time, a pool) has one of these words
LIMIT_WORDS = {"max", "timeout", "interval", "period", "idle", "age", "retry", "stall", "grace",
               "ping", "threads"}  # fmt: skip
NOT_LIMITS = {"--torch-threads"}  # the step's compute, not a bound on callers


def _limit_flags() -> dict[str, object]:
    parser = build_parser()
    (subcommands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {}
    for action in subcommands.choices["serve"]._actions:
        long = [name for name in action.option_strings if name.startswith("--")]
        words = set(long[0][2:].split("-")) if long else set()
        if words & LIMIT_WORDS and "no" not in words and long[0] not in NOT_LIMITS:
            flags[long[0]] = action.default
    return flags


def _renderings(default: object) -> list[str]:
    """How a table may write `default`: 30.0 as 30, 67108864 as 64 MiB."""
    if isinstance(default, bool) or not isinstance(default, (int, float)):
        return [""]  # None: derived or off, said in words
    forms = [f"{default:g}", f"{default:,}"]
    if isinstance(default, int) and default >= 1 << 20 and default % (1 << 20) == 0:
        forms.append(f"{default >> 20} MiB")
    return forms


def test_every_limit_and_timeout_flag_is_in_a_table_row_with_its_default() -> None:
    rows = [line for line in OPERATIONS.read_text().splitlines() if line.startswith("|")]
    flags = _limit_flags()
    assert len(flags) > 20, sorted(flags)  # the pattern still finds them
    missing = []
    for flag, default in flags.items():
        named = [row for row in rows if re.search(rf"`{re.escape(flag)}`", row)]
        if not any(form in row for row in named for form in _renderings(default)):
            missing.append(f"{flag} (default {default!r})")
    assert not missing, "not in a table row of docs/operations.md with its default: " + ", ".join(
        missing
    )
