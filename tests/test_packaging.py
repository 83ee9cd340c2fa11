"""Installing asyncengine: engine + server need no dev tools and no triton; triton comes with
the `cuda` extra (and `dev`, for the kernel tests), and nothing imports it unless asked to."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asyncengine.testing import free_ports
from asyncengine.worker import cpu_ops

ROOT = Path(__file__).resolve().parents[1]
DEV_TOOLS = ("pytest", "hypothesis", "ruff", "mypy", "grpcio-tools", "matplotlib")
# gRPC backs off between failed connects (1 s, 1.6 s, 2.6 s, ...): a poller's default channel
# saw a server that came up after 30 s of imports ~15 s late; 100 ms between connects does not
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 100),
]


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
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# -- a built wheel, installed without -e, serves ------------------------------------------------

# what the Dockerfile copies into the image before its `pip install .`
WHEEL_SOURCES = ("pyproject.toml", "README.md", "asyncengine")

# Run by the wheel's venv, with the stubs the wheel installed.
STREAM_ONE = """
import json, sys
import grpc
import asyncengine
from asyncengine.v1 import control_pb2, control_pb2_grpc, generation_pb2 as pb, generation_pb2_grpc
with grpc.insecure_channel(sys.argv[1]) as channel:
    info = control_pb2_grpc.ControlStub(channel).GetModelInfo(control_pb2.GetModelInfoRequest())
    request = pb.GenerateRequest(
        text="The",
        stopping=pb.StoppingOptions(max_new_tokens=4, ignore_eos=True),
        response=pb.ResponseOptions(return_token_ids=True),
    )
    stream = generation_pb2_grpc.GenerationStub(channel).GenerateStream(request, timeout=60)
    responses = list(stream)
print(json.dumps({
    "file": asyncengine.__file__,
    "model": info.model_name,
    "events": [r.WhichOneof("event") for r in responses],
    "token_ids": [i for r in responses if r.HasField("delta") for i in r.delta.token_ids],
}))
"""


def _run(command: list[str | Path], **kwargs: Any) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result.stdout


def _build_wheel(tmp_path: Path) -> Path:
    """A wheel of the checkout, built from a copy so the build leaves nothing in the tree."""
    src = tmp_path / "src"
    src.mkdir()
    for name in WHEEL_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    dist = tmp_path / "dist"
    pip_wheel: list[str | Path] = ["wheel", "-q", "--no-deps", "-w", dist, src]
    try:  # this environment's setuptools, if pyproject.toml accepts it: no index, seconds faster
        if int(importlib.metadata.version("setuptools").split(".")[0]) >= 68:
            pip_wheel.append("--no-build-isolation")
    except importlib.metadata.PackageNotFoundError:
        pass  # pip fetches it for an isolated build
    _run([sys.executable, "-m", "pip", *pip_wheel])
    (wheel,) = dist.glob("asyncengine-*.whl")
    return wheel


def _venv_with_these_dependencies(venv: Path, env: dict[str, str], cwd: Path) -> Path:
    """A fresh venv whose sys.path ends with this environment's site-packages: the dependencies
    without the project (Python runs no .pth file of a plain path line's directory, so no
    editable-install finder). Returns the venv's own site-packages."""
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site_packages = Path(_run([python, "-c", code]).strip())
    ours = sysconfig.get_paths()
    (site_packages / "dependencies.pth").write_text(f"{ours['purelib']}\n{ours['platlib']}\n")
    code = "import importlib.util; print(importlib.util.find_spec('asyncengine'))"
    assert _run([python, "-c", code], env=env, cwd=cwd).strip() == "None", "the checkout leaks in"
    return site_packages


def _wait_serving(proc: subprocess.Popen[bytes], target: str, log: Path) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    deadline = time.monotonic() + 180
    with grpc.insecure_channel(target, options=FAST_RECONNECT) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"serve exited {proc.returncode}:\n{log.read_text()}"
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == serving:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"serve not SERVING after 180 s:\n{log.read_text()}")


def test_a_built_wheel_installed_without_e_serves_its_default_model(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    elsewhere = tmp_path / "elsewhere"  # the working directory: outside the checkout
    elsewhere.mkdir()
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"OMP_NUM_THREADS": "1", "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"}
    site_packages = _venv_with_these_dependencies(venv, env, elsewhere)
    pip_install: list[str | Path] = [
        "--python",
        venv / "bin" / "python",
        "install",
        "-q",
        "--no-deps",
        "--no-index",
    ]
    _run([sys.executable, "-m", "pip", *pip_install, wheel])

    (port,) = free_ports(1)
    target = f"127.0.0.1:{port}"
    serve = ["serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    log = tmp_path / "serve.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [venv / "bin" / "asyncengine", *serve, "--torch-threads", "1"],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
            cwd=elsewhere,
        )
        try:
            _wait_serving(proc, target, log)
            out = _run([venv / "bin" / "python", "-c", STREAM_ONE, target], env=env, cwd=elsewhere)
        finally:
            proc.send_signal(signal.SIGTERM)
            returncode = proc.wait(60)
    reply = json.loads(out)
    # the client's asyncengine is the wheel's, and so is the server's: the bundled default model
    # it serves is found beside the package it imported
    assert Path(reply["file"]).is_relative_to(site_packages), reply["file"]
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    (started,) = [r for r in records if r.get("event") == "engine_started"]
    assert Path(started["model"]) == site_packages / "asyncengine" / "default_model", started
    assert reply["model"] == "default_model"  # served under its directory's name
    assert reply["events"][0] == "accepted" and reply["events"][-2:] == ["finished", "usage"]
    assert len(reply["token_ids"]) == 4, reply
    assert returncode == 0, log.read_text()
    if cpu_ops.is_loaded():  # the wheel ships these C++ sources, so it loads their cached build
        (ready,) = [r for r in records if r.get("event") == "cpu_ops_ready"]
        assert ready["was_built"] is False, ready
