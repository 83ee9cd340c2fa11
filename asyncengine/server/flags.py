"""Command-line flags made from a dataclass's fields: each group a table of field -> help.

The dataclass (ServeOptions, EngineArgs) owns each flag's type and default; a table owns its
help and its place in `--help`. A field in no table, or in two, is an error when the parser
is built, so a new option cannot go missing from `--help`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FlagGroup:
    """One section of `--help`: its title, a line on what it holds, and field -> help."""

    title: str
    description: str
    flags: dict[str, str]


def flag_of(name: str, field_type: object, takes_list: bool = False) -> str:
    """The flag of a field: `max_num_seqs` -> `--max-num-seqs`; a tuple field
    (`auth_tokens`) is a repeated flag named in the singular (`--auth-token`), unless it
    `takes_list` (one flag, many values: `--lora-modules a=x b=y`, as vLLM's)."""
    if str(field_type).startswith("tuple") and not takes_list:
        name = name.removesuffix("s")
    return "--" + name.replace("_", "-")


def takes_list(field: dataclasses.Field[Any]) -> bool:
    """A tuple field whose flag takes one or more values at once (its metadata says so)."""
    return bool(field.metadata.get("takes_list"))


def add_flag_groups(
    parser: argparse.ArgumentParser, cls: type, groups: list[FlagGroup], defaults: Any = None
) -> dict[str, argparse._ArgumentGroup]:
    """Add one flag per field of dataclass `cls`, in `groups`; returns the groups by title.

    Defaults come from `defaults` (an instance) or the fields' own; each help line gets
    "(default: ...)" unless it says "default:" itself.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    placed = [name for group in groups for name in group.flags]
    unknown = set(placed) - fields.keys()
    missing = fields.keys() - set(placed)
    if unknown or missing or len(placed) != len(set(placed)):
        raise AssertionError(
            f"{cls.__name__} flags: unknown {sorted(unknown)}, missing {sorted(missing)}, "
            "or placed twice"
        )
    added = {}
    for group in groups:
        section = parser.add_argument_group(group.title, group.description)
        for name, text in group.flags.items():
            _add(section, fields[name], text, defaults)
        added[group.title] = section
    return added


def _add(
    section: argparse._ArgumentGroup, field: dataclasses.Field[Any], text: str, defaults: Any
) -> None:
    flag = flag_of(field.name, field.type, takes_list(field))
    kind = str(field.type).split(" |")[0]
    if takes_list(field):  # one or more values, and more with the flag repeated
        metavar = field.metadata.get("metavar")
        section.add_argument(
            flag, nargs="+", action="extend", default=None, metavar=metavar, help=text
        )
        return
    if kind.startswith("tuple"):  # repeated; the environment may add more (serve_options_from)
        section.add_argument(flag, action="append", default=None, help=text)
        return
    if defaults is not None:
        default = getattr(defaults, field.name)
    else:
        default = None if field.default is dataclasses.MISSING else field.default
    text += "" if "default:" in text else " (default: %(default)s)"
    if kind == "bool":
        action: Any = argparse.BooleanOptionalAction
        section.add_argument(flag, action=action, default=default, help=text)
        return
    parse: Any = {"int": int, "float": float}.get(kind, str)
    section.add_argument(flag, type=parse, default=default, help=text)
