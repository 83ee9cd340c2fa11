"""OutputBatch: the steps an engine process makes while its front is busy, in one message.

A request's DELTA outputs over several steps must reach the front as the one output that
`RequestOutput.extend` would make of them (tokens in order, text joined, logprobs kept, its
final kept); a CUMULATIVE request's latest output replaces the earlier; every step's figures
and prefix-cache events come in order; and nothing is sent twice.
"""

from __future__ import annotations

import copy

import msgspec

from asyncengine.core.kv_events import KvEvent, KvEventKind
from asyncengine.engine.llm_engine import EngineStats
from asyncengine.engine.messages import FromEngine, StepOutputs, StepStats
from asyncengine.engine.output_batch import OutputBatch
from asyncengine.outputs import (
    CompletionOutput,
    FinishReason,
    Logprob,
    RequestMetrics,
    RequestOutput,
)

STATS = EngineStats(*[0] * 13)  # type: ignore[arg-type]


def delta(request_id: str, step: int, index: int = 0, *, finished: bool = False) -> RequestOutput:
    """A DELTA output of `request_id` at `step`: one token (10 * step + index) and its text."""
    token = 10 * step + index
    completion = CompletionOutput(
        index, f"t{step}.{index} ", [token], [{token: Logprob(-1.0 * step)}],
        finish=FinishReason.LENGTH if finished else None, cumulative_logprob=-float(step),
    )  # fmt: skip
    metrics = RequestMetrics(arrival_time=0.0, num_output_tokens=step + 1)
    return RequestOutput(request_id, "prompt", [1, 2], [completion], finished, metrics=metrics)


def step_stats(num_tokens: int) -> StepStats:
    return StepStats(0.001, 0.002, 0.003, num_tokens, 0, 0)


def over_the_wire(message: StepOutputs) -> StepOutputs:
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=FromEngine)
    assert isinstance(decoded, StepOutputs)
    return decoded


def test_delta_outputs_of_many_steps_come_as_one_output_per_request() -> None:
    batch = OutputBatch()
    batch.track("a", is_delta=True)
    batch.track("b", is_delta=True)
    # "a" has two samples, each step reporting one of them; "b" ends at step 3
    steps = [[delta("a", s, s % 2), *([delta("b", s, finished=s == 3)] if s <= 3 else [])]
             for s in range(6)]  # fmt: skip
    expected = {}
    for outputs in copy.deepcopy(steps):
        for out in outputs:
            if out.request_id in expected:
                expected[out.request_id].extend(out)
            else:
                expected[out.request_id] = out
    for outputs in steps:
        batch.add(outputs, step_stats(len(outputs)))

    message = over_the_wire(batch.take(STATS))

    a, b = message.outputs
    assert (a.request_id, b.request_id) == ("a", "b")
    assert [c.token_ids for c in a.outputs] == [[0, 20, 40], [11, 31, 51]]
    assert a.outputs[0].text == "t0.0 t2.0 t4.0 "
    assert [list(entry) for entry in a.outputs[1].logprobs or []] == [[11], [31], [51]]
    assert b.outputs[0].token_ids == [0, 10, 20, 30] and b.finished
    assert b.outputs[0].finish is FinishReason.LENGTH
    for got in (a, b):
        want = expected[got.request_id]
        assert got.outputs == want.outputs
        assert (got.finished, got.metrics) == (want.finished, want.metrics)
        assert (got.prompt, got.prompt_token_ids) == (None, [])  # the front has the prompt
    assert [s.num_generated_tokens for s in message.steps] == [2, 2, 2, 2, 1, 1]


def test_a_cumulative_output_replaces_the_earlier_and_a_final_is_kept_once() -> None:
    batch = OutputBatch()
    batch.track("c", is_delta=False)
    batch.track("d", is_delta=True)
    first = RequestOutput("c", None, [], [CompletionOutput(0, "x", [7])], False)
    latest = RequestOutput("c", None, [], [CompletionOutput(0, "xy", [7, 8])], False)
    batch.add([first, delta("d", 0)], step_stats(2))
    batch.add([latest, delta("d", 1, finished=True)], step_stats(2))

    message = batch.take(STATS)

    c, d = message.outputs
    assert c.outputs[0].token_ids == [7, 8] and c.outputs[0].text == "xy"
    assert d.outputs[0].token_ids == [0, 10] and d.finished
    assert [out.request_id for out in message.outputs if out.finished] == ["d"]
    assert not batch  # taken: nothing is sent twice


def test_an_abort_final_after_deltas_ends_the_merged_output() -> None:
    batch = OutputBatch()
    batch.track("e", is_delta=True)
    batch.add([delta("e", 0)], step_stats(1))
    batch.add([RequestOutput.aborted("e", 1)], None)  # an abort's final: no step

    (e,) = batch.take(STATS).outputs

    assert e.finished and e.outputs[0].finish is FinishReason.ABORTED
    assert e.outputs[0].token_ids == [0] and e.outputs[0].text == "t0.0 "


def test_figures_events_and_phases_of_every_step_are_kept_in_order() -> None:
    batch = OutputBatch()
    stored = [KvEvent(KvEventKind.STORED, block_hash=h) for h in (1, 2)]
    batch.add([], step_stats(3), {"a": "prefill"}, stored[:1])
    batch.add([], step_stats(4), None, stored[1:])
    assert batch

    message = batch.take(STATS)

    assert [s.num_generated_tokens for s in message.steps] == [3, 4]
    assert [e.block_hash for e in message.kv_events] == [1, 2]
    assert message.phases == {"a": "prefill"}  # the latest sent
    assert message.outputs == []
    assert not batch
