"""The server's layers, read from its imports (type-only ones too): the core (state.py,
call.py) and metrics know no front end and no proto; the HTTP front end knows nothing of gRPC's;
only app.py (and the CLI above it) puts the front ends together."""

from __future__ import annotations

import ast
from pathlib import Path

import asyncengine.server

SERVER = Path(asyncengine.server.__file__).parent
# what belongs to one front end, or assembles them
GRPC = ("asyncengine.server.servicer_", "asyncengine.server.convert",
        "asyncengine.server.health", "asyncengine.server.decode", "asyncengine.v1")  # fmt: skip
HTTP = ("asyncengine.server.http",)
ASSEMBLY = ("asyncengine.server.app", "asyncengine.server.cli")


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code (TYPE_CHECKING blocks included);
    `from package import name` counts as importing `package.name` too."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def reaching(path: Path, prefixes: tuple[str, ...]) -> list[str]:
    return sorted(name for name in imports_of(path) if name.startswith(prefixes))


def test_the_server_core_and_metrics_import_no_front_end() -> None:
    for name in ("state.py", "call.py", "abort_reason.py", "metrics.py"):
        assert reaching(SERVER / name, GRPC + HTTP + ASSEMBLY) == [], name


def test_the_http_front_end_imports_nothing_of_grpcs() -> None:
    files = sorted((SERVER / "http").glob("*.py"))
    assert files
    for path in files:
        assert reaching(path, GRPC + ASSEMBLY) == [], path.name


def test_the_grpc_front_end_imports_nothing_of_https() -> None:
    files = [*SERVER.glob("servicer_*.py"), SERVER / "convert.py", SERVER / "health.py"]
    for path in files:
        assert reaching(path, HTTP + ASSEMBLY) == [], path.name
