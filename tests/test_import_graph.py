"""The package's import graph, read from the source: no circles, and the layers the design asks
for (docs/architecture.md, STYLE.md: `core/` never imports torch, `server/` only translates).

Every import statement counts, wherever it is: at module level, inside a function, under
`if TYPE_CHECKING`. An edge goes to the module an import names: `from pkg import name` names the
submodule `pkg.name` when there is one, else `pkg`; the parent packages that Python also runs
on the way are not edges (every module would then be in a circle with `asyncengine/__init__`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "asyncengine"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imported_names(module: str) -> Iterator[str]:
    """Each module (or top-level name, for imports from outside the package) it imports."""
    path = _modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                yield submodule if submodule in _modules() else source


@cache
def _graph() -> dict[str, frozenset[str]]:
    """module -> the asyncengine modules it imports."""
    return {
        module: frozenset(
            name for name in _imported_names(module) if _is_under(name, "asyncengine")
        )
        - {module}
        for module in _modules()
    }


def _is_under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _cycles(graph: dict[str, frozenset[str]], limit: int = 100) -> list[list[str]]:
    """Elementary cycles, each from its smallest module (up to `limit` of them)."""
    found: list[list[str]] = []

    def walk(start: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(path[-1], ())):
            if len(found) >= limit:
                return
            if nxt == start:
                found.append([*path, start])
            elif nxt > start and nxt not in path:
                walk(start, [*path, nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def _imports_from(modules: str, packages: tuple[str, ...]) -> list[str]:
    """'a -> b' for each import of the modules under `modules` from any of `packages`
    (imports from outside asyncengine too: "torch")."""
    return [
        f"{module} -> {name}"
        for module in _modules()
        if _is_under(module, modules)
        for name in sorted(set(_imported_names(module)))
        if any(_is_under(name, package) for package in packages)
    ]


def test_every_import_of_asyncengine_names_a_module_of_the_package() -> None:
    # a package kept outside the package directory (kernels/ was) shows up here
    missing = [
        f"{module} -> {name}"
        for module, names in _graph().items()
        for name in sorted(names)
        if name not in _modules()
    ]
    assert not missing, missing


def test_the_package_has_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_core_imports_no_torch_and_nothing_above_it() -> None:
    above = ("worker", "engine", "server", "models", "distributed", "kernels")
    packages = ("torch", "triton", *(f"asyncengine.{name}" for name in above))
    assert not _imports_from("asyncengine.core", packages)


def test_config_imports_nothing_it_configures() -> None:
    above = ("core", "worker", "models", "engine", "server", "distributed", "kernels")
    packages = tuple(f"asyncengine.{name}" for name in above)
    assert not _imports_from("asyncengine.config", packages)


def test_the_model_files_reader_imports_no_torch_and_no_other_layer() -> None:
    assert "asyncengine.model_files" in _modules(), "no asyncengine/model_files.py"
    assert not _imports_from("asyncengine.model_files", ("torch", "asyncengine"))


def test_only_the_server_and_its_test_hooks_import_the_server() -> None:
    outside = [
        line
        for line in _imports_from("asyncengine", ("asyncengine.server",))
        if not line.startswith(("asyncengine.server", "asyncengine.testing "))
    ]
    assert not outside, outside


def test_the_engine_imports_nothing_from_the_server() -> None:
    assert not _imports_from("asyncengine.engine", ("asyncengine.server",))


def test_the_server_reaches_no_tensors_directly() -> None:
    # the server translates to engine calls: an error type it needs lives in asyncengine.errors
    assert not _imports_from("asyncengine.server", ("asyncengine.worker", "asyncengine.models"))
