"""What a server builds at start-up is frozen out of the collector's reach (issue 24).

A burst of 2,000 streams made full collections run in the server, and each walked every object
start-up had built: the front ends' too (grpc, FastAPI, pydantic), which the engine's own
freeze came too early to take. A 247 ms collection lined up with a canary's worst gap.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from serving_http import http_server


def test_start_freezes_the_front_ends_it_built(model_dir: Any) -> None:
    """gc.get_objects() lists what full collections walk; frozen objects are not in it."""
    model: Path = model_dir("llama")
    with http_server(model, "--no-engine-process", fake_runner=True) as served:
        built = [served.state, served.front_ends, served.front_ends.http]
        walked = {id(obj) for obj in gc.get_objects()}
        assert [type(obj).__name__ for obj in built if id(obj) in walked] == []
        assert gc.get_freeze_count() > 0
