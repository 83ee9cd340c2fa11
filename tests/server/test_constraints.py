"""Structured outputs over gRPC: the `constraint` oneof of GenerateStream and Generate, errors
that name its field, and the metrics of grammar compiles and constrained requests."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from typing import Any

import grpc
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncengine import AsyncLLMEngine
from asyncengine.server import app
from asyncengine.server.cli import build_parser, engine_args_from
from asyncengine.server.options import check_options, serve_options_from
from asyncengine.v1 import generation_pb2 as pb

from .utils import bad_field, stubs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "label": {"type": "string", "minLength": 1, "maxLength": 6},
        "kind": {"enum": ["cat", "dog"]},
        "parts": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
    },
    "required": ["id", "label", "kind", "parts"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{2}\d{3}"
CHOICES = ["alpha", "beta", "감마"]
BAD = [
    ("json_schema", {"json_schema": '{"type": "bogus"}'}),
    # xgrammar compiles it, to a grammar that finishes arrays with repeated items: refused
    ("json_schema", {"json_schema": '{"type": "array", "uniqueItems": true}'}),
    ("json_schema", {"json_schema": "{not json"}),
    ("regex", {"regex": "(unclosed"}),
    ("grammar", {"grammar": "root ::= missing_rule"}),
    ("choice.choices", {"choice": pb.Choices()}),
    ("json_object", {"json_object": False}),
]


def sampled(seed: int, n: int = 1) -> pb.SamplingOptions:
    return pb.SamplingOptions(temperature=1.0, seed=seed, n=n)


def texts_of(responses: list[pb.GenerateResponse]) -> dict[int, tuple[str, int]]:
    """sample index -> (its text, its finish reason) from one stream's messages."""
    text: dict[int, str] = {}
    reasons: dict[int, int] = {}
    for response in responses:
        if response.HasField("delta"):
            delta = response.delta
            text[delta.sample_index] = text.get(delta.sample_index, "") + delta.text
        elif response.HasField("finished"):
            reasons[response.finished.sample_index] = response.finished.reason
    return {i: (text.get(i, ""), reasons[i]) for i in reasons}


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_constraints_through_grpc(model_dir: Any) -> None:
    async def main() -> dict[Any, float]:
        argv = ["serve", "--model", str(model_dir("llama")), "--host", "127.0.0.1"]
        argv += ["--port", "0", "--device", "cpu", "--metrics-port", "0"]
        argv += ["--num-gpu-blocks-override", "512", "--num-cpu-blocks-override", "16"]
        ns = build_parser().parse_args(argv)
        options = serve_options_from(ns)
        check_options(options)
        engine = AsyncLLMEngine.from_engine_args(engine_args_from(ns))
        server, state, port = await app.start(engine, options)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await check_calls(*stubs(channel))
            assert state.metrics is not None and state.metrics.port is not None
            return await asyncio.to_thread(scrape, state.metrics.port)
        finally:
            assert await app.stop(server, state) == 0

    metrics = asyncio.run(main())

    def count(name: str, kind: str) -> float:
        return metrics[(f"asyncengine_{name}", (("kind", kind),))]

    assert count("structured_output_requests_total", "json") == 8
    assert count("structured_output_requests_total", "regex") == 6
    assert count("structured_output_requests_total", "choice") == 6
    # each spec compiled once: the other requests took it from the cache
    for kind in ("json", "regex", "choice"):
        assert count("grammar_compile_seconds_count", kind) == 1, kind
        assert count("grammar_compile_seconds_sum", kind) > 0
    # the engine's compiled-grammar cache and compile pool (one grammar per kind kept)
    assert metrics[("asyncengine_grammar_cache_entries", ())] == 3
    assert metrics[("asyncengine_grammar_cache_bytes", ())] > 0
    assert metrics[("asyncengine_grammar_compile_busy_seconds_total", ())] > 0
    assert metrics[("asyncengine_grammar_compiles_dropped_total", ())] == 0
    assert metrics[("asyncengine_grammar_compile_timeouts_total", ())] == 0


async def check_calls(generation: Any, control: Any) -> None:
    def json_request(i: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            text=f"json please {i}",
            sampling=sampled(seed=i, n=2),
            stopping=pb.StoppingOptions(max_new_tokens=200),
            json_schema=json.dumps(SCHEMA),
            disable_any_whitespace=True,
        )

    streams = await asyncio.gather(
        *(_read(generation.GenerateStream(json_request(i))) for i in range(8))
    )
    for responses in streams:
        samples = texts_of(responses)
        assert sorted(samples) == [0, 1]
        for text, reason in samples.values():
            assert reason == pb.EOS, text
            jsonschema.validate(json.loads(text), SCHEMA)
    prompts = [pb.Prompt(text=f"code {i}") for i in range(6)]
    for constraint, check in (
        ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text)),
        ({"choice": pb.Choices(choices=CHOICES)}, lambda text: text in CHOICES),
    ):
        batch = pb.GenerateBatchRequest(
            prompts=prompts,
            sampling=sampled(seed=3),
            stopping=pb.StoppingOptions(max_new_tokens=32),
            **constraint,
        )
        results = (await generation.Generate(batch, timeout=60)).results
        assert len(results) == len(prompts)
        for result in results:
            assert check(result.text) and result.finish_reason == pb.EOS, result
    for field, constraint in BAD:
        request = pb.GenerateRequest(text="hello", **constraint)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _read(generation.GenerateStream(request, timeout=10))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_field(error.value) == field
        batch = pb.GenerateBatchRequest(prompts=[pb.Prompt(text="hello")], **constraint)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generation.Generate(batch, timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_field(error.value) == field


async def _read(call: Any) -> list[pb.GenerateResponse]:
    return [response async for response in call]
