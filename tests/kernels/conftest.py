"""Kernel tests run the Triton kernels on CPU tensors in Triton's interpreter.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before anything imports
asyncengine.kernels (test modules import it inside tests, through the `kernels` fixture). Other
test directories use torch only and are unaffected. A missing triton fails every test here
rather than skipping them: CI installs triton.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
if "triton" in sys.modules:
    # transformers imports triton when it is installed (tests/conftest.py imports transformers),
    # so triton's own @jit functions (tl.zeros, tl.max, ...) were built for a GPU. Import its
    # Python modules again, now in interpreter mode; the compiled extension (triton._C) stays.
    assert "asyncengine.kernels" not in sys.modules, "kernels imported before the interpreter"
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        if not name.startswith("triton._C"):
            del sys.modules[name]


@pytest.fixture(scope="session")
def kernels() -> ModuleType:
    """`asyncengine.kernels`, imported under the interpreter; fails loudly without triton."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"triton is required for the kernel tests (pip install triton): {exc}")
    import asyncengine.kernels

    return asyncengine.kernels


@pytest.fixture(autouse=True)
def _one_thread_fresh_seed(request: pytest.FixtureRequest) -> Iterator[None]:
    # the interpreter's cost is Python per operation; extra torch threads only contend
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))  # fresh inputs for each case
    try:
        yield
    finally:
        torch.set_num_threads(previous)
