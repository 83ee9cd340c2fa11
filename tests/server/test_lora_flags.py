"""`serve --lora-modules` and `--allow-runtime-lora-updating` (issue 28): vLLM's two entry forms,
every malformed entry refused naming the flag, and both flags refused without --enable-lora."""

from __future__ import annotations

import json

import pytest

from asyncengine.server.cli import build_parser
from asyncengine.server.lora import (
    LoRAModule,
    check_lora_modules,
    check_lora_options,
    parse_lora_module,
)
from asyncengine.server.options import ServeOptions, serve_options_from

BASE = frozenset({"tiny-llama", "/models/tiny-llama"})


def options_of(*flags: str) -> ServeOptions:
    return serve_options_from(build_parser().parse_args(["serve", *flags]))


def test_lora_modules_takes_many_entries_in_both_forms_in_order() -> None:
    entry = json.dumps({"name": "sql", "path": "/a/sql", "base_model_name": "tiny-llama"})
    options = options_of("--lora-modules", "chat=/a/chat", entry, "--lora-modules", "x=/a/x")
    assert options.lora_modules == ("chat=/a/chat", entry, "x=/a/x")
    modules = check_lora_options(options, is_lora_enabled=True)
    assert modules == [
        LoRAModule("chat", "/a/chat"),
        LoRAModule("sql", "/a/sql", "tiny-llama"),
        LoRAModule("x", "/a/x"),
    ]


def test_no_lora_flags_means_no_adapters_and_no_runtime_updates() -> None:
    options = options_of()
    assert (options.lora_modules, options.allow_runtime_lora_updating) == ((), False)
    assert check_lora_options(options, is_lora_enabled=False) == []


def test_a_path_may_hold_an_equals_sign() -> None:
    assert parse_lora_module("a=/data/run=3") == LoRAModule("a", "/data/run=3")


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("just-a-name", "neither name=path"),
        ("=/path", "neither name=path"),
        ("name=", "neither name=path"),
        ('{"name": "a"', "not valid JSON"),
        ('{"name": "a"}', "needs the keys name and path"),
        ('{"name": "a", "path": "/p", "rank": 8}', "unknown keys ['rank']"),
        ('{"name": "", "path": "/p"}', "non-empty strings"),
        ('{"name": "a", "path": 3}', "non-empty strings"),
        ('{"name": "a", "path": "/p", "base_model_name": 1}', "non-empty strings"),
    ],
)
def test_a_malformed_entry_is_refused_naming_the_flag(value: str, says: str) -> None:
    with pytest.raises(ValueError, match="--lora-modules") as raised:
        parse_lora_module(value)
    assert says in str(raised.value)


@pytest.mark.parametrize(
    "flags",
    [["--lora-modules", "a=/p"], ["--allow-runtime-lora-updating"]],
)
def test_lora_flags_need_enable_lora(flags: list[str]) -> None:
    with pytest.raises(ValueError, match=f"{flags[0]} needs --enable-lora"):
        check_lora_options(options_of(*flags), is_lora_enabled=False)


def test_names_must_be_unique_and_apart_from_the_base_model() -> None:
    with pytest.raises(ValueError, match="'a' is given twice"):
        check_lora_modules([LoRAModule("a", "/p"), LoRAModule("a", "/q")], BASE)
    with pytest.raises(ValueError, match="'tiny-llama' is the base model's own name"):
        check_lora_modules([LoRAModule("tiny-llama", "/p")], BASE)
    with pytest.raises(ValueError, match="base_model_name 'other'"):
        check_lora_modules([LoRAModule("a", "/p", "other")], BASE)
    check_lora_modules([LoRAModule("a", "/p", "tiny-llama"), LoRAModule("b", "/q")], BASE)
