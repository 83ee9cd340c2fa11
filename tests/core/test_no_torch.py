"""`asyncengine.core` is pure Python: importing it (and the request types) never loads torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_core_imports_with_torch_blocked() -> None:
    code = textwrap.dedent(
        """
        import importlib.abc, sys

        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError(f"{name} is blocked: asyncengine.core must not need it")
                return None

        sys.meta_path.insert(0, NoTorch())
        import asyncengine.core.block_manager
        import asyncengine.core.scheduler
        from asyncengine import SamplingParams, EngineArgs, RequestOutput
        from asyncengine.core.request import FinishReason, Request

        Request("r", [1, 2, 3], SamplingParams(max_tokens=4))
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
