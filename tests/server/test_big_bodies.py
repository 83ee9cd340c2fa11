"""Big bodies do not stall other streams (issue 24): a canary stream's worst gap stays small
while another process sends each body of issue 24's table to the HTTP port, and it is refused.

The attacker is a process of its own (benchmarks/big_bodies.py's `attack`), so the gap measures
the server, not a client building or sending 30 MB in the canary's process.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from asyncengine.v1 import generation_pb2 as pb

from .utils import ServerProcess, bad_field, greedy_request, stubs

# the canary's normal gap is a few ms; today's main stalls it 0.45-1.4 s on these bodies on a
# quiet machine, and the better of two tries counts (see the test)
MAX_GAP_S = 0.3
# issue 24's table, resized so that main's stall is well over a loaded machine's noise: the
# nested prompt at a third (its 30 MB take this side ~0.05 s to split), logit_bias at ten times,
# stop at three, gRPC's ids at four (grpc copies a message into bytes on the loop before any
# handler: ~2 ms a MB that only --max-message-size bounds). The 63 MB text is left to
# benchmarks/big_bodies.py: main takes 0.1-0.2 s on it, too near the noise to tell apart.
BIG_BODIES = [
    "http_nested_3e4", "http_ids", "http_logit_bias_1e6", "http_stop_3e6", "grpc_ids_60m",
]  # fmt: skip
_SCRIPT = Path(__file__).parents[2] / "benchmarks" / "big_bodies.py"


def _big_bodies() -> Any:
    spec = importlib.util.spec_from_file_location("big_bodies", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def served(
    model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, str]]:
    log_path = tmp_path_factory.mktemp("server-bodies") / "server.log"
    # 64 MiB (the default is 8 MiB): these bodies are read and parsed, as an operator who
    # raises the limit gets them
    flags = ("--http-port", "0", "--max-message-size", str(64 << 20))
    server = ServerProcess(model_dir("llama"), log_path, *flags)
    try:
        server.wait_serving(timeout=300)
        yield server, f"127.0.0.1:{server.logged_port('http_serving')}"
    finally:
        server.stop()


@pytest.mark.parametrize("body", BIG_BODIES)
def test_a_big_body_is_refused_without_stalling_other_streams(
    served: tuple[ServerProcess, str], body: str
) -> None:
    """The better of two tries counts: on a shared 2-core machine another process can take the
    CPU from the server for a moment, but a stall the body causes comes back in both."""
    server, http = served
    big_bodies = _big_bodies()
    results = []
    for _ in range(2):
        result = asyncio.run(big_bodies.measure(body, server.target, http))
        assert result["status"] in (400, 413, grpc.StatusCode.INVALID_ARGUMENT.value[0]), result
        results.append(result)
        if result["worst_gap_s"] < MAX_GAP_S:
            return
    best = min(results, key=lambda r: r["worst_gap_s"])
    raise AssertionError(
        f"another stream went silent for {best['worst_gap_s']:.2f} s (median gap "
        f"{best['median_gap_s'] * 1000:.1f} ms) while {body} was refused (the better of 2)"
    )


def _with_unknown_fields(message: Any, num_bytes: int) -> bytes:
    """`message` serialized with unknown fields (number 1000) of `num_bytes` in all: a request
    big enough to be parsed off the loop that the server must serve as if they were not there."""
    payload = b"u" * 60_000
    tag_and_length = bytes([0xC2, 0x3E]) + bytes([0xE0, 0xD4, 0x03])  # field 1000, 60000 bytes
    return message.SerializeToString() + (tag_and_length + payload) * (num_bytes // 60_000)


def test_a_big_request_is_parsed_off_the_loop_and_served(
    served: tuple[ServerProcess, str],
) -> None:
    server, _ = served
    single = _with_unknown_fields(greedy_request("Hello", 4), 300_000)
    batch = pb.GenerateBatchRequest(
        prompts=[pb.Prompt(text="Hello"), pb.Prompt(token_ids=pb.TokenIds(ids=[5, 6, 7]))],
        sampling=pb.SamplingOptions(temperature=0.0),
        stopping=pb.StoppingOptions(max_new_tokens=3, ignore_eos=True),
        response=pb.ResponseOptions(return_token_ids=True),
    )
    with server.channel() as channel:
        stream = channel.unary_stream("/asyncengine.v1.Generation/GenerateStream")
        replies = [pb.GenerateResponse.FromString(r) for r in stream(single, timeout=60)]
        assert replies[-1].HasField("usage") and replies[-1].usage.completion_tokens == 4
        unary = channel.unary_unary("/asyncengine.v1.Generation/Generate")
        reply = pb.GenerateBatchResponse.FromString(
            unary(_with_unknown_fields(batch, 300_000), timeout=60)
        )
        assert [len(r.token_ids) for r in reply.results] == [3, 3]
        # the same batch parsed at once, small: the same tokens
        small = stubs(channel)[0].Generate(batch, timeout=60)
        assert [list(r.token_ids) for r in small.results] == [
            list(r.token_ids) for r in reply.results
        ]


def test_a_big_request_over_a_bound_is_refused_naming_the_field_unparsed(
    served: tuple[ServerProcess, str],
) -> None:
    server, _ = served
    cases = [
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 1_000_000)), "token_ids"),
        (pb.GenerateRequest(text="x", stopping=pb.StoppingOptions(stop=["ab"] * 100_000)),
         "stopping.stop"),
        (pb.GenerateBatchRequest(prompts=[pb.Prompt(text="") for _ in range(200_000)]),
         "prompts"),
    ]  # fmt: skip
    with server.channel() as channel:
        generation, _ = stubs(channel)
        for request, field in cases:
            call = generation.Generate if field == "prompts" else generation.GenerateStream
            with pytest.raises(grpc.RpcError) as raised:
                reply = call(request, timeout=60)
                list(reply) if field != "prompts" else None
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
            assert bad_field(raised.value) == field
        # invalid UTF-8 in a prompt of a big batch: named where it is
        bad = pb.GenerateBatchRequest(prompts=[pb.Prompt(text="ok")] * 3).SerializeToString()
        bad = bad.replace(b"ok", b"o\xff", 1)  # as long: the framing holds
        data = _with_unknown_fields(pb.GenerateBatchRequest(), 0) + bad
        data += _with_unknown_fields(pb.GenerateBatchRequest(), 300_000)
        with pytest.raises(grpc.RpcError) as raised:
            channel.unary_unary("/asyncengine.v1.Generation/Generate")(data, timeout=60)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_field(raised.value) == "prompts[0].text"
