"""The engine process's outputs not sent yet: steps made while the front has not taken the last.

The engine process steps faster than a busy front takes outputs (its event loop writes to
callers under the GIL). A `StepOutputs` per step would cost the front a decode, its metrics
and a hand-off to its loop each; instead, while the front has not acknowledged the last
message (`OutputsTaken`), the steps' outputs gather here and go in one message: a request's
DELTA outputs merged into one (tokens in order, text joined, its final kept), a CUMULATIVE
one replaced by its latest, every step's figures and KV events kept in order.
"""

from __future__ import annotations

from asyncengine.core.kv_events import KvEvent
from asyncengine.engine.llm_engine import EngineStats
from asyncengine.engine.messages import StepOutputs, StepStats
from asyncengine.outputs import RequestOutput, merge_deltas


class OutputBatch:
    """Outputs, step figures and KV events gathered for one `StepOutputs`."""

    def __init__(self) -> None:
        self._delta_ids: set[str] = set()  # requests in flight that want DELTA outputs
        # by request id, in the order they first came: the first output and the later ones
        self._outputs: dict[str, tuple[RequestOutput, list[RequestOutput]]] = {}
        self._steps: list[StepStats] = []
        self._kv_events: list[KvEvent] = []
        self._phases: dict[str, str] | None = None

    def track(self, request_id: str, is_delta: bool) -> None:
        """A request the engine queued: whether its outputs are DELTAs (merged, not replaced)."""
        if is_delta:
            self._delta_ids.add(request_id)

    def add(
        self,
        outputs: list[RequestOutput],
        step: StepStats | None,
        phases: dict[str, str] | None = None,
        kv_events: list[KvEvent] | None = None,
    ) -> None:
        """One step's outputs (or an abort's finals: `step` None), after those added before."""
        gathered = self._outputs
        for out in outputs:
            out.prompt, out.prompt_token_ids = None, []  # the front's stream has the prompt
            is_delta = out.request_id in self._delta_ids
            if out.finished:
                self._delta_ids.discard(out.request_id)
            earlier = gathered.get(out.request_id)
            if earlier is not None and is_delta:
                earlier[1].append(out)
            else:  # the first, or a CUMULATIVE one: the latest carries everything
                gathered[out.request_id] = (out, [])
        if step is not None:
            self._steps.append(step)
        if phases is not None:
            self._phases = phases
        if kv_events:
            self._kv_events += kv_events

    def __bool__(self) -> bool:
        return bool(self._outputs or self._steps or self._kv_events)

    def take(self, stats: EngineStats) -> StepOutputs:
        """Everything gathered, as one message with the engine's figures now; then empty."""
        outputs = []
        for first, later in self._outputs.values():
            if later:
                merge_deltas(first, later)
            outputs.append(first)
        message = StepOutputs(outputs, self._steps, stats, self._phases, self._kv_events)
        self._outputs, self._steps, self._kv_events, self._phases = {}, [], [], None
        return message
