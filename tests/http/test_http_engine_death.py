"""Engine death over HTTP (issue 24): a stream under way ends with the `engine_dead` error event,
a new request gets 503 `engine_dead` (what retrying clients treat as transient), and the
server stops with exit code 1."""

from __future__ import annotations

import functools
import json
import urllib.error
import urllib.request

import openai
import pytest
from serving_http import ServerThread

from asyncengine import testing

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FAULT_AT_STEP = 40


def test_engine_death_reaches_http_callers_as_503_engine_dead(model_dir) -> None:
    argv = ["--model", str(model_dir("llama")), "--host", "127.0.0.1", "--port", "0"]
    argv += ["--http-port", "0", "--device", "cpu", "--dtype", "float32", "--no-engine-process"]
    served = ServerThread(argv, fake_runner=True)
    # the step loop raises at its 40th step: a fatal error, as a real fault would be
    served._factory = functools.partial(
        testing.hooked_llm_engine, fake_runner=True, fault_at=FAULT_AT_STEP, step_delay_s=0.005
    )
    served.start()
    try:
        stream = served.client().completions.create(
            model=served.model, prompt="a", max_tokens=1000, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        with pytest.raises(openai.APIError) as failed:
            for _chunk in stream:
                pass
        assert "engine" in str(failed.value) and "injected" not in str(failed.value)
        request = urllib.request.Request(
            served.base_url + "/v1/completions",
            data=json.dumps({"model": served.model, "prompt": "a", "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 503
        error = json.loads(refused.value.read())["error"]
        assert error["code"] == "engine_dead" and "the engine stopped" in error["message"]
    finally:
        assert served.stop() == 1
