"""RequestStream merges the DELTA outputs a caller has not taken yet, all at once on take."""

from __future__ import annotations

import asyncio
import copy

from asyncengine.engine.request_stream import RequestStream
from asyncengine.outputs import (
    CompletionOutput,
    FinishReason,
    Logprob,
    RequestMetrics,
    RequestOutput,
)


def _delta(step: int, index: int, *, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(
        index, f"t{step}.{index} ", [10 * step + index], [{10 * step + index: Logprob(-1.0)}],
        finish=FinishReason.LENGTH if finished else None, cumulative_logprob=-float(step),
    )  # fmt: skip
    metrics = RequestMetrics(arrival_time=0.0, num_output_tokens=step)
    return RequestOutput("r", None, [1, 2], [completion], finished, metrics=metrics)


def test_outputs_put_before_a_take_come_merged_as_extend_would_merge_them() -> None:
    # two samples, each step's output carrying one of them (as forked samples report)
    outputs = [_delta(step, step % 2, finished=step == 5) for step in range(6)]
    expected = copy.deepcopy(outputs[0])
    for later in copy.deepcopy(outputs[1:]):
        expected.extend(later)

    async def main() -> tuple[RequestOutput | None, RequestOutput | None]:
        stream = RequestStream("r", is_delta=True, num_samples=2)
        for out in outputs:
            stream.put(out)
        taken = await stream.get()
        stream.put(_delta(6, 0))
        return taken, await stream.get()

    taken, after = asyncio.run(main())
    assert taken == expected
    assert after is not None and after.outputs[0].token_ids == [60]  # nothing carried over
