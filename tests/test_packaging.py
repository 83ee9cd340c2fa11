"""Installing asyncengine: engine + server need no dev tools and no triton; triton comes with
the `cuda` extra (and `dev`, for the kernel tests), and nothing imports it unless asked to."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEV_TOOLS = ("pytest", "hypothesis", "ruff", "mypy", "grpcio-tools", "matplotlib")


def names(requirements: list[str]) -> set[str]:
    """Distribution names of requirement strings ("triton>=3.6; ..." -> "triton")."""
    return {
        req.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()
        for req in requirements
    }


def test_a_plain_install_pulls_no_triton_and_no_dev_tools() -> None:
    import tomllib  # (3.11+, like the project)

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = names(project["dependencies"])
    assert "triton" not in base
    assert not base & set(DEV_TOOLS)
    extras = project["optional-dependencies"]
    assert "triton" in names(extras["cuda"])
    assert "triton" in names(extras["dev"])  # the kernel tests under TRITON_INTERPRET=1


# Run in a fresh interpreter that sees every installed package except triton, as on a machine
# where it was never installed (a finder that only blocks the import would still be "found").
WITHOUT_TRITON = """
import importlib.util, sys
assert importlib.util.find_spec("triton") is None
from asyncengine import LLM, EngineArgs, SamplingParams
import asyncengine.server.app, asyncengine.server.cli
llm = LLM(model=sys.argv[1], device="cpu", num_gpu_blocks_override=16, num_cpu_blocks_override=0)
(out,) = llm.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True))
assert len(out.outputs[0].token_ids) == 3
try:
    EngineArgs(model=sys.argv[1], attention_backend="triton").create_engine_config()
except ValueError as exc:
    assert "triton is not installed" in str(exc), exc
else:
    raise AssertionError("attention_backend='triton' without triton was accepted")
assert "triton" not in sys.modules, "something imported triton"
import asyncengine.kernels  # loads nothing until a kernel is used
try:
    asyncengine.kernels.store_kv
except ModuleNotFoundError as exc:
    assert exc.name == "triton", exc
else:
    raise AssertionError("a kernel loaded without triton")
print("ok")
"""


def test_engine_and_server_run_where_triton_is_not_installed(model_dir, tmp_path: Path) -> None:
    site_packages = Path(sysconfig.get_paths()["purelib"])
    mirror = tmp_path / "site-packages"
    mirror.mkdir()
    for entry in site_packages.iterdir():
        if not entry.name.lower().startswith("triton"):
            (mirror / entry.name).symlink_to(entry)
    result = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            f"import site; site.addsitedir({str(mirror)!r})\n" + WITHOUT_TRITON,
            str(model_dir("llama")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        # from the checkout's root, where Python also finds kernels/ as a top-level package
        # that transformers imports while it probes for Hugging Face's `kernels`
        cwd=ROOT,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
