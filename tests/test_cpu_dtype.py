"""dtype="auto" on the CPU: bfloat16 where the CPU multiplies bf16 natively, float32 elsewhere,
and the start-up log says which and why."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from asyncengine import EngineArgs
from asyncengine.config import cpu_bf16_flag

FLAGS = "fpu vme sse sse2 avx2 avx512f avx512bw"


def write_cpuinfo(path: Path, extra_flags: str) -> Path:
    path.write_text(f"processor\t: 0\nflags\t\t: {FLAGS} {extra_flags}\n\nprocessor\t: 1\n")
    return path


@pytest.mark.parametrize(
    ("extra_flags", "expected"),
    [
        ("avx512_bf16", "avx512_bf16"),
        ("amx_tile amx_bf16 avx512_bf16", "amx_bf16"),
        ("avx_vnni", None),
        ("", None),
    ],
)
def test_native_bf16_is_read_from_the_cpu_flags(
    tmp_path: Path, extra_flags: str, expected: str | None
) -> None:
    assert cpu_bf16_flag(str(write_cpuinfo(tmp_path / "cpuinfo", extra_flags))) == expected


@pytest.mark.parametrize(("flag", "expected"), [("avx512_bf16", "bfloat16"), (None, "float32")])
def test_auto_on_the_cpu_follows_native_bf16_and_logs_why(
    model_dir, monkeypatch: pytest.MonkeyPatch, flag: str | None, expected: str
) -> None:
    monkeypatch.setattr("asyncengine.config.cpu_bf16_flag", lambda: flag)
    with capture_logs() as logs:
        config = EngineArgs(model=str(model_dir("llama")), device="cpu").create_engine_config()
    assert config.model_config.dtype == expected
    (line,) = [entry for entry in logs if entry["event"] == "dtype_auto"]
    assert line["dtype"] == expected
    assert (flag or "neither amx_bf16 nor avx512_bf16") in line["reason"]


def test_an_explicit_dtype_wins_over_auto(model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("asyncengine.config.cpu_bf16_flag", lambda: "avx512_bf16")
    args = EngineArgs(model=str(model_dir("llama")), device="cpu", dtype="float32")
    assert args.create_engine_config().model_config.dtype == "float32"
