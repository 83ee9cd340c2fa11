"""Fuzz every field of every request message the server takes, with values drawn from the .proto.

Each example is one to three concurrent calls. Every call must end OK with a well-formed reply,
or with a code that names the bad field (google.rpc BadRequest), or RESOURCE_EXHAUSTED with a
retry hint; never UNKNOWN, INTERNAL or a deadline. Meanwhile a bystander greedy stream on its
own connection runs again and again and must always produce the text it produces alone. By the
end, every field at every depth of every request has been set in some call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, MethodDescriptor
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from asyncengine.v1 import control_pb2 as cpb
from asyncengine.v1 import generation_pb2 as pb

from .proto_strategies import (
    FIELD_HINTS,
    Limits,
    Strategies,
    field_path_exists,
    literal,
    token_id_values,
    weighted,
)
from .utils import SERVING, ServerProcess, bad_field, check_stream_shape, detail, events, stubs

NUM_EXAMPLES = 1000  # about 45 s on 2 cores (100 s when other work keeps them busy)
SHRINK_BUDGET_S = 120.0
CALL_TIMEOUT_S = 30.0  # every fuzzed call is small: running past this means the server hung
MAX_CALLS_AT_ONCE = 3
SERVICES = [
    pb.DESCRIPTOR.services_by_name["Generation"],
    cpb.DESCRIPTOR.services_by_name["Control"],
]
NOT_FUZZED = {
    "Drain": "stops admission on the shared server for good",
    "Resume": "the undo of Drain, which is not fuzzed",
    "WatchLoad": "a stream that never ends",
}
FUZZED = [m for service in SERVICES for m in service.methods if m.name not in NOT_FUZZED]
# codes for a request that is wrong: each must name the field (BadRequest); NOT_FOUND is a
# `lora_name` the server has no adapter of
FIELD_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
}
# the main server runs without --allow-runtime-lora-updating: these are refused whatever they hold
LORA_UPDATES = {"LoadLoRA", "UnloadLoRA"}
BYSTANDER = pb.GenerateRequest(
    text="양자역학 설명해줄래? The capital of France is",
    sampling=pb.SamplingOptions(temperature=0.0),
    stopping=pb.StoppingOptions(max_new_tokens=64, ignore_eos=True),
)


class StopFuzzing(BaseException):
    """Ends the run at once: the server died or hung, or shrinking ran out of time. (Not an
    Exception, so Hypothesis does not go on shrinking against a server that cannot answer.)"""


class Call:
    """One RPC to make; its repr is the request as a Python expression (see `literal`)."""

    def __init__(self, method: MethodDescriptor, request: Message) -> None:
        self.method = method
        self.request = request

    def __repr__(self) -> str:
        return f"{self.method.name}({literal(self.request)})"


@dataclass
class Outcome:
    code: grpc.StatusCode
    responses: list[Any]  # a stream's messages, or the one reply of a unary call
    error: grpc.RpcError | None = None


@pytest.fixture(scope="module")
def server(server_pool: Any) -> ServerProcess:
    return server_pool["main"]


def test_tables_name_real_methods_and_fields() -> None:
    """A renamed RPC or field fails here rather than silently narrowing the fuzzing."""
    methods = {m.name for service in SERVICES for m in service.methods}
    assert set(NOT_FUZZED) <= methods
    assert set(REPLY_CHECKS) == {m.name for m in FUZZED}
    names = {path.rsplit(".", 1)[-1] for path in _request_field_paths()}
    assert set(FIELD_HINTS) <= names


@pytest.mark.filterwarnings("ignore:Generating overly large repr")  # of the strategies
def test_fuzz_every_request_field(server: ServerProcess) -> None:
    with server.channel() as channel, _own_channel(server) as bystander_channel:
        generation, control = stubs(channel)
        info = control.GetModelInfo(cpb.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S)
        limits = Limits(info.vocab_size, info.max_context_length, info.max_num_seqs)
        max_admitted = info.max_num_seqs + info.max_queued_requests
        invoke = _invoker({s.name: stub for s, stub in zip(SERVICES, (generation, control))})
        health = health_pb2_grpc.HealthStub(channel)
        alone = check_stream_shape(list(generation.GenerateStream(BYSTANDER, timeout=60)))
        call = _calls(Strategies(limits))
        pool = ThreadPoolExecutor(MAX_CALLS_AT_ONCE)
        drawn: set[str] = set()  # the field paths set in some request
        smallest = _SmallestFailure()

        @settings(
            max_examples=NUM_EXAMPLES,
            derandomize=True,  # the same examples every run: a failure reproduces
            database=None,
            # shrinking two or more failures against a server takes minutes: fix one at a time
            report_multiple_bugs=False,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(st.lists(call, min_size=1, max_size=MAX_CALLS_AT_ONCE))
        def fuzz(calls: list[Call]) -> None:
            smallest.check_time()
            for call in calls:
                drawn.update(_set_paths(call.request, f"{call.request.DESCRIPTOR.name}."))
            log_start = server.log_path.stat().st_size
            outcomes = list(pool.map(invoke, calls))
            ends = [
                f"call {i} ended {o.code.name}: {c!r}"
                for i, (c, o) in enumerate(zip(calls, outcomes))
            ]
            _check_still_serving(server, health, outcomes, ends, log_start)
            try:
                for call, outcome in zip(calls, outcomes):
                    _check(call, outcome, limits, max_admitted)
            except AssertionError as exc:
                report = "\n".join(
                    [
                        *ends,
                        f"{type(exc).__name__}: {str(exc)[:3000]}",
                        _log_since(server, log_start),
                    ]
                )
                note(report)
                smallest.record(calls, report)
                raise

        with pool, Bystander(bystander_channel, alone) as bystander:
            fuzz()
        assert bystander.num_runs >= 1
        assert bystander.failures == [], bystander.failures
        _assert_idle(control)
    # the fuzz's own breadth: nearly every field at every depth is set at least once (the
    # deepest oneof members, e.g. choice.choices, are drawn a few times per run, and the
    # draws vary with Hypothesis's state across a session: two may be missed in a run)
    missing = _request_field_paths() - drawn
    assert len(missing) <= 2, f"fields the fuzzing never set: {sorted(missing)}"


class _SmallestFailure:
    """The smallest failing example so far, reported if shrinking runs past SHRINK_BUDGET_S
    (Hypothesis would go on for up to 5 minutes, each try a few calls to the server)."""

    def __init__(self) -> None:
        self.first_at: float | None = None
        self.size = 0
        self.report = ""

    def record(self, calls: list[Call], report: str) -> None:
        size = sum(c.request.ByteSize() + 1 for c in calls)
        if self.first_at is None or size < self.size:
            self.size, self.report = size, report
        self.first_at = self.first_at or time.monotonic()

    def check_time(self) -> None:
        if self.first_at is not None and time.monotonic() - self.first_at > SHRINK_BUDGET_S:
            raise StopFuzzing(
                f"shrinking ran past {SHRINK_BUDGET_S} s; the smallest failure:\n{self.report}"
            )


def _calls(strategies: Strategies) -> st.SearchStrategy[Call]:
    """A call of a FUZZED method, weighted by how many fields its request has (8 at least)."""
    return weighted(
        *(
            (max(8, len(list(_field_paths(m.input_type)))), st.builds(Call, st.just(m), s))
            for m in FUZZED
            for s in [strategies.message(m.input_type)]
        )
    )


# -- one call ---------------------------------------------------------------------------------


def _invoker(methods: dict[str, Any]) -> Callable[[Call], Outcome]:
    def invoke(call: Call) -> Outcome:
        stub_method = getattr(methods[call.method.containing_service.name], call.method.name)
        try:
            if call.method.server_streaming:
                responses = list(stub_method(call.request, timeout=CALL_TIMEOUT_S))
            else:
                responses = [stub_method(call.request, timeout=CALL_TIMEOUT_S)]
        except grpc.RpcError as error:
            return Outcome(error.code(), [], error)
        return Outcome(grpc.StatusCode.OK, responses)

    return invoke


def _check(call: Call, outcome: Outcome, limits: Limits, max_admitted: int) -> None:
    """How `call` ended is one of the good endings (raises AssertionError otherwise)."""
    code, request, error = outcome.code, call.request, outcome.error
    if code == grpc.StatusCode.OK:
        out_of_vocab = [(p, v) for p, v in token_id_values(request) if v >= limits.vocab_size]
        assert not out_of_vocab, f"OK for token ids >= vocab_size: {out_of_vocab[:3]}"
        REPLY_CHECKS[call.method.name](request, outcome.responses, limits)
    elif call.method.name in LORA_UPDATES:
        assert code == grpc.StatusCode.FAILED_PRECONDITION, code
        assert detail(error, error_details_pb2.ErrorInfo).reason == "RUNTIME_LORA_UPDATING_DISABLED"
    elif code in FIELD_CODES:
        field = bad_field(error)
        assert field_path_exists(call.method.input_type, field), f"{code.name} names {field!r}"
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        detail(error, error_details_pb2.RetryInfo)
        num_prompts = len(getattr(request, "prompts", ()))
        assert num_prompts <= max_admitted, f"a retry hint for {num_prompts} prompts"
    else:
        assert error is not None
        raise AssertionError(f"ended {code.name}: {error.details()}")


def _check_stream(request: pb.GenerateRequest, responses: list[Any], limits: Limits) -> None:
    """The shape of check_stream_shape, per sample when n > 1, and the options honoured."""
    num_samples = request.sampling.n or 1
    if num_samples == 1:
        check_stream_shape(responses)
    kinds = events(responses)
    assert kinds[0] == "accepted" and kinds[-1] == "usage", kinds
    assert kinds[-1 - num_samples : -1] == ["finished"] * num_samples, kinds
    assert set(kinds[1 : -1 - num_samples]) <= {"delta", "heartbeat"}, kinds
    seqs = [getattr(r, kind).sequence_number for r, kind in zip(responses[1:], kinds[1:])]
    assert seqs == list(range(1, len(responses))), seqs
    finished = [r.finished for r in responses if r.HasField("finished")]
    assert sorted(f.sample_index for f in finished) == list(range(num_samples)), finished
    assert all(f.reason != pb.FINISH_REASON_UNSPECIFIED for f in finished), finished
    offsets = [0] * num_samples
    for delta in (r.delta for r in responses if r.HasField("delta")):
        new = delta.completion_tokens - delta.token_offset
        assert delta.token_offset == offsets[delta.sample_index] and new >= 0, delta
        offsets[delta.sample_index] = delta.completion_tokens
        _check_tokens(list(delta.token_ids), new, request.response, limits)
        if request.response.HasField("logprobs"):
            assert len(delta.logprobs) == new, delta
            assert all(len(e.top) <= request.response.logprobs for e in delta.logprobs), delta
    usage = responses[-1].usage
    assert usage.completion_tokens == sum(offsets), (usage, offsets)
    assert usage.prompt_tokens == responses[0].accepted.prompt_tokens, usage
    if request.stopping.HasField("max_new_tokens"):
        assert max(offsets) <= request.stopping.max_new_tokens, offsets


def _check_batch(request: pb.GenerateBatchRequest, responses: list[Any], limits: Limits) -> None:
    (reply,) = responses
    assert len(reply.results) == len(request.prompts), len(reply.results)
    for result in reply.results:
        assert result.finish_reason != pb.FINISH_REASON_UNSPECIFIED, result
        num_tokens = result.usage.completion_tokens
        _check_tokens(list(result.token_ids), num_tokens, request.response, limits)
        if request.stopping.HasField("max_new_tokens"):
            assert num_tokens <= request.stopping.max_new_tokens, result.usage


def _check_tokens(
    token_ids: list[int], num_tokens: int, options: pb.ResponseOptions, limits: Limits
) -> None:
    if options.return_token_ids:
        assert len(token_ids) == num_tokens, (token_ids, num_tokens)
    assert all(t < limits.vocab_size for t in token_ids), token_ids


def _check_tokenize(request: pb.TokenizeRequest, responses: list[Any], limits: Limits) -> None:
    (reply,) = responses
    assert len(reply.results) == len(request.texts), len(reply.results)
    for result in reply.results:
        num_tokens = len(result.token_ids)
        assert result.token_count == num_tokens, result.token_count
        assert not request.truncate or num_tokens <= request.truncate, num_tokens
        assert all(t < limits.vocab_size for t in result.token_ids), result.token_ids
        assert len(result.tokens) == (num_tokens if request.return_tokens else 0)
        assert len(result.offsets) == (num_tokens if request.return_offsets else 0)


def _check_detokenize(request: pb.DetokenizeRequest, responses: list[Any], limits: Limits) -> None:
    assert len(responses[0].texts) == len(request.sequences), responses[0]


def _check_abort(request: cpb.AbortRequest, responses: list[Any], limits: Limits) -> None:
    assert set(responses[0].aborted_ids) <= set(request.request_ids), responses[0]


def _check_model_info(request: Any, responses: list[Any], limits: Limits) -> None:
    assert responses[0].vocab_size == limits.vocab_size, responses[0]


def _check_server_info(request: Any, responses: list[Any], limits: Limits) -> None:
    assert not responses[0].draining, responses[0]


def _check_list_loras(request: Any, responses: list[Any], limits: Limits) -> None:
    assert list(responses[0].adapters) == [], responses[0]  # LoRA is off on this server


def _never_ok(request: Any, responses: list[Any], limits: Limits) -> None:
    raise AssertionError("OK on a server without --allow-runtime-lora-updating")


REPLY_CHECKS: dict[str, Callable[[Any, list[Any], Limits], None]] = {
    "GenerateStream": _check_stream,
    "Generate": _check_batch,
    "Tokenize": _check_tokenize,
    "Detokenize": _check_detokenize,
    "Abort": _check_abort,
    "GetModelInfo": _check_model_info,
    "GetServerInfo": _check_server_info,
    "ListLoRAs": _check_list_loras,
    "LoadLoRA": _never_ok,
    "UnloadLoRA": _never_ok,
}


# -- the server and the bystander ---------------------------------------------------------------


def _check_still_serving(
    server: ServerProcess, health: Any, outcomes: list[Outcome], ends: list[str], log_start: int
) -> None:
    """Raise StopFuzzing if a call hung or the server stopped serving (waits a little for it)."""
    codes = {o.code for o in outcomes}
    if grpc.StatusCode.UNAVAILABLE in codes:  # no drain here: the engine is dead or exiting
        why = "a call ended UNAVAILABLE"
    elif grpc.StatusCode.DEADLINE_EXCEEDED in codes:
        why = f"a call had no answer within {CALL_TIMEOUT_S} s: the server hung"
    else:
        deadline = time.monotonic() + 10.0
        while (code := server.proc.poll()) is None and time.monotonic() < deadline:
            try:
                request = health_pb2.HealthCheckRequest(service="")
                if health.Check(request, timeout=1.0).status == SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        why = "the server is " + ("not SERVING" if code is None else f"gone (exit code {code})")
    raise StopFuzzing("\n".join([why, *ends]) + _log_since(server, log_start))


def _log_since(server: ServerProcess, offset: int, limit: int = 4000) -> str:
    """The server's log lines from `offset` on, less the bystander's."""
    with open(server.log_path, errors="replace") as log:
        log.seek(offset)
        lines = [line for line in log if '"request_id": "bystander-' not in line]
    return "\nserver log:\n" + "".join(lines)[-limit:]


def _assert_idle(control: Any, within_s: float = 10.0) -> None:
    """No request is left behind: nothing running, waiting or swapped, and every block free."""
    deadline = time.monotonic() + within_s
    while True:
        load = control.GetServerInfo(cpb.GetServerInfoRequest(), timeout=CALL_TIMEOUT_S).load
        idle = (load.running, load.waiting, load.swapped) == (0, 0, 0)
        if idle and load.gpu_blocks_free == load.gpu_blocks_total:
            return
        assert time.monotonic() < deadline, f"not idle: {load}"
        time.sleep(0.05)


def _own_channel(server: ServerProcess) -> grpc.Channel:
    """A channel with its own connection (gRPC would otherwise share one per target)."""
    assert server.root_cert is None, "the main server is plaintext"
    options = [("grpc.use_local_subchannel_pool", 1)]
    return grpc.insecure_channel(server.target, options=options)


class Bystander:
    """The BYSTANDER stream, run back to back on its own channel until the fuzzing ends."""

    def __init__(self, channel: grpc.Channel, expected_text: str) -> None:
        self._stub = stubs(channel)[0]
        self._expected = expected_text
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.num_runs = 0
        self.failures: list[str] = []

    def __enter__(self) -> Bystander:
        self._thread.start()
        assert self._started.wait(CALL_TIMEOUT_S), "the bystander stream never started"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2 * CALL_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stop.is_set() and not self.failures:
            request = pb.GenerateRequest()
            request.CopyFrom(BYSTANDER)
            request.request_id = f"bystander-{self.num_runs}"
            try:
                responses = []
                for response in self._stub.GenerateStream(request, timeout=CALL_TIMEOUT_S):
                    responses.append(response)
                    self._started.set()
                text = check_stream_shape(responses)
                if text != self._expected:
                    self.failures.append(f"run {self.num_runs}: {text!r} != {self._expected!r}")
            except (grpc.RpcError, AssertionError) as exc:
                self.failures.append(f"run {self.num_runs}: {exc!r}")
            self.num_runs += 1
        self._started.set()


def _request_field_paths() -> set[str]:
    """`GenerateRequest.stopping.stop`, ...: every field, at every depth, of every request."""
    inputs = {m.input_type for m in FUZZED}
    return {path for d in inputs for path in _field_paths(d, f"{d.name}.")}


# -- descriptors --------------------------------------------------------------------------------


def _field_paths(descriptor: Descriptor, prefix: str = "") -> Iterator[str]:
    for field in descriptor.fields:
        yield prefix + field.name
        if field.message_type is not None:
            yield from _field_paths(field.message_type, f"{prefix}{field.name}.")


def _set_paths(msg: Message, prefix: str = "") -> Iterator[str]:
    for field, value in msg.ListFields():
        yield prefix + field.name
        if field.message_type is not None:
            for item in value if field.is_repeated else [value]:
                yield from _set_paths(item, f"{prefix}{field.name}.")
