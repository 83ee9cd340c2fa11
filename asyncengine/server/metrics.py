"""Prometheus metrics of one server, served over HTTP on a port of their own (--metrics-port).

Load gauges and the counters the engine already keeps are read from `get_stats()` when
Prometheus scrapes (from the HTTP thread: plain reads of ints and list lengths). The step loop
reports the rest through the `EngineObserver` calls: its steps' figures, a batch at a time, and
per finished request its latencies, computed from the request's own timings, not per token.
Every server has its own registry, so several can share one process (tests, benchmarks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import asyncengine
from asyncengine.engine.async_llm_engine import AsyncLLMEngine, StepStats
from asyncengine.engine.llm_engine import EngineStats
from asyncengine.outputs import RequestOutput
from asyncengine.server.abort_reason import AbortReason
from asyncengine.server.batch_histogram import BatchHistogram

P = "asyncengine_"
FINISH_REASONS = ("stop", "length", "cancelled", "deadline", "aborted", "error")
# why the server aborted a request (Flight.abort_reason) -> the finished-request label; an
# aborted request with no reason was left by its client: "cancelled" too
_ABORT_LABELS = {
    AbortReason.CANCELLED: "cancelled",
    AbortReason.TIME_LIMIT: "deadline",
    AbortReason.ABORTED_BY_SERVER: "aborted",
}

# seconds; wide ranges, as a CPU box and an H100 differ by orders of magnitude
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
_COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0, 60.0)  # fmt: skip
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class _EngineCollector(Collector):
    """Gauges and engine-kept counters, read at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self._engine = engine
        config = engine.config
        self._info = {
            "model": model_name,
            "model_path": config.model_config.model,
            "architecture": config.model_config.architecture,
            "dtype": config.model_config.dtype,
            "device": config.device_config.device,
            "block_size": str(config.cache_config.block_size),
            "version": asyncengine.__version__,
        }

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.get_stats()
        if self._engine.config.lora_config is not None:
            yield from _lora_metrics(stats, sorted(self._engine.lora_requests()))
        info = GaugeMetricFamily(P + "info", "The served model and engine (value 1)",
                                 labels=list(self._info))  # fmt: skip
        info.add_metric(list(self._info.values()), 1)
        yield info
        for state, value in (
            ("running", stats.num_running),
            ("waiting", stats.num_waiting),
            ("swapped", stats.num_swapped),
        ):
            yield GaugeMetricFamily(P + f"requests_{state}", f"Requests {state}", value=value)
        usage = GaugeMetricFamily(
            P + "block_usage_ratio",
            "Used / total KV blocks per pool (gpu: the device pool, also on a CPU device; cpu: "
            "the swap pool). Scale out on the gpu pool; alert above 0.85",
            labels=["pool"],
        )
        usage.add_metric(["gpu"], stats.gpu_block_usage)
        usage.add_metric(["cpu"], stats.cpu_block_usage)
        yield usage
        blocks = GaugeMetricFamily(P + "kv_blocks", "KV blocks per pool", labels=["pool"])
        blocks.add_metric(["gpu"], stats.num_gpu_blocks)
        blocks.add_metric(["cpu"], stats.num_cpu_blocks)
        yield blocks
        preemptions = CounterMetricFamily(
            P + "preemptions", "Requests preempted, by mode", labels=["mode"]
        )
        preemptions.add_metric(["swap"], stats.num_preemptions_swap)
        preemptions.add_metric(["recompute"], stats.num_preemptions_recompute)
        yield preemptions
        yield CounterMetricFamily(
            P + "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            value=stats.num_prefix_cache_queries,
        )
        yield CounterMetricFamily(
            P + "prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            value=stats.num_prefix_cache_hits,
        )
        yield from _grammar_metrics(stats)
        if stats.spec_method is not None:
            yield from _spec_decode_metrics(stats)


def _spec_decode_metrics(stats: EngineStats) -> Iterator[Metric]:
    """Speculative decoding's counters (vLLM's spec_decode names), by proposer."""
    labels, method = ["method"], [stats.spec_method or ""]
    for name, text, value in (
        ("num_drafts", "Draft runs proposed and checked (one per request per step)",
         stats.num_spec_drafts),
        ("num_draft_tokens", "Draft tokens proposed", stats.num_spec_draft_tokens),
        ("num_accepted_tokens", "Draft tokens accepted", stats.num_spec_accepted_tokens),
    ):  # fmt: skip
        counter = CounterMetricFamily(P + "spec_decode_" + name, text, labels=labels)
        counter.add_metric(method, value)
        yield counter
    per_position = CounterMetricFamily(
        P + "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in their draft run",
        labels=[*labels, "position"],
    )
    for position, value in enumerate(stats.num_spec_accepted_per_position):
        per_position.add_metric([*method, str(position)], value)
    yield per_position
    drafts, tokens = stats.num_spec_drafts, stats.num_spec_draft_tokens
    rate = GaugeMetricFamily(
        P + "spec_decode_acceptance_rate",
        "Accepted / proposed draft tokens since start",
        labels=labels,
    )
    rate.add_metric(method, stats.num_spec_accepted_tokens / tokens if tokens else 0.0)
    yield rate
    length = GaugeMetricFamily(
        P + "spec_decode_mean_accepted_length",
        "Tokens a speculating request gets per step (accepted drafts + 1) since start",
        labels=labels,
    )
    length.add_metric(method, 1 + stats.num_spec_accepted_tokens / drafts if drafts else 0.0)
    yield length


def _lora_metrics(stats: EngineStats, names: list[str]) -> Iterator[Metric]:
    """LoRA adapters: how many are served (`names`), cached and resident, their loads and
    evictions, and each served adapter's running and waiting requests (0 when it has none, so
    its series stays continuous while it is loaded)."""
    adapters = GaugeMetricFamily(
        P + "lora_adapters",
        "LoRA adapters by state: registered (served by name), cached (weights in host memory, "
        "at most --max-cpu-loras), resident (in a device slot, at most --max-loras)",
        labels=["state"],
    )
    adapters.add_metric(["registered"], len(names))
    adapters.add_metric(["cached"], stats.num_cached_loras)
    adapters.add_metric(["resident"], stats.num_active_loras)
    yield adapters
    yield CounterMetricFamily(
        P + "lora_loads", "Adapters copied into a device slot", value=stats.num_lora_loads
    )
    yield CounterMetricFamily(
        P + "lora_evictions",
        "Adapters evicted (least recently used) to make room for another",
        value=stats.num_lora_evictions,
    )
    yield CounterMetricFamily(
        P + "lora_host_evictions",
        "Adapters' host copies dropped (least recently used) past --max-cpu-loras",
        value=stats.num_lora_host_evictions,
    )
    yield CounterMetricFamily(
        P + "lora_disk_reads",
        "Adapters read from disk: at registration, and again after a host eviction",
        value=stats.num_lora_disk_reads,
    )
    requests = GaugeMetricFamily(
        P + "lora_requests",
        "Requests of each LoRA adapter: running, or waiting (queued or swapped out)",
        labels=["lora_name", "state"],
    )
    total = CounterMetricFamily(
        P + "lora_requests_admitted",
        "Requests admitted for each LoRA adapter since start",
        labels=["lora_name"],
    )
    for name in names:
        requests.add_metric([name, "running"], stats.lora_running.get(name, 0))
        requests.add_metric([name, "waiting"], stats.lora_waiting.get(name, 0))
        total.add_metric([name], stats.lora_requests_total.get(name, 0))
    yield requests
    yield total


def _grammar_metrics(stats: EngineStats) -> Iterator[Metric]:
    """The compiled-grammar cache and the compile pool, as the engine counts them."""
    yield GaugeMetricFamily(
        P + "grammar_cache_bytes",
        "Bytes of compiled grammars kept for reuse (bounded by --max-grammar-cache-bytes)",
        value=stats.grammar_cache_bytes,
    )
    yield GaugeMetricFamily(
        P + "grammar_cache_entries", "Compiled grammars kept", value=stats.num_cached_grammars
    )
    yield CounterMetricFamily(
        P + "grammar_compile_busy_seconds",
        "Seconds grammar compiles ran, including those whose callers had left",
        value=stats.grammar_compile_busy_s,
    )
    yield CounterMetricFamily(
        P + "grammar_compiles_dropped",
        "Grammar compiles never started: their callers left while they were queued",
        value=stats.num_grammar_compiles_dropped,
    )
    yield CounterMetricFamily(
        P + "grammar_compile_timeouts",
        "Requests refused because their grammar ran past --max-grammar-compile-s",
        value=stats.num_grammar_compile_timeouts,
    )


class ServerMetrics:
    """The metrics of one server; an `EngineObserver` of its engine.

    `abort_reason_of(request_id)` tells why the server aborted a request (Flight.abort_reason;
    None: the client went away), so finished requests are counted by the right reason.
    """

    def __init__(
        self,
        engine: AsyncLLMEngine,
        abort_reason_of: Callable[[str], AbortReason | None],
        model_name: str,
    ) -> None:
        self.registry = CollectorRegistry()
        self._abort_reason_of = abort_reason_of
        self.port: int | None = None  # of the HTTP endpoint, once started
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        r = self.registry
        r.register(_EngineCollector(engine, model_name))
        self.prompt_tokens = Counter(
            P + "prompt_tokens", "Prompt tokens of requests that ended (if ever scheduled)",
            registry=r,
        )  # fmt: skip
        self.generation_tokens = Counter(
            P + "generation_tokens", "Tokens sampled, counted per step", registry=r
        )
        self.swapped_blocks = Counter(
            P + "swapped_blocks", "KV blocks moved between the pools", ["direction"], registry=r
        )
        self.requests_finished = Counter(
            P + "requests_finished",
            "Requests ended, by reason: stop (eos, stop string or token), length (max tokens or "
            "context), cancelled (by the client or Control.Abort), deadline (time_limit_ms), "
            "aborted (by the server: drain, shutdown), error",
            ["reason"],
            registry=r,
        )
        for reason in FINISH_REASONS:
            self.requests_finished.labels(reason)
        self.stalled_streams = Counter(
            P + "stalled_streams",
            "Streams ended because the client read nothing for the stall time (their unread "
            "output dropped)",
            registry=r,
        )
        for direction in ("out", "in"):
            self.swapped_blocks.labels(direction)
        self.ttft = Histogram(
            P + "time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds",
            "Mean gap between a request's output tokens; one observation per finished request",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "Arrival to last token of requests finished by stop or length",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            P + "request_queue_time_seconds",
            "Arrival to first scheduled",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.schedule_time = BatchHistogram(
            P + "step_schedule_seconds", "Scheduler time per step", _STEP_BUCKETS, r
        )
        self.forward_time = BatchHistogram(
            P + "step_forward_seconds",
            "Block moves + forward + sampling per step",
            _STEP_BUCKETS,
            r,
        )
        self.update_time = BatchHistogram(
            P + "step_update_seconds",
            "Token appends, stop checks and detokenization per step",
            _STEP_BUCKETS,
            r,
        )

        self.structured_requests = Counter(
            P + "structured_output_requests",
            "Requests with a structured-outputs constraint, queued, by kind (json, regex, "
            "choice, grammar, json_object)",
            ["kind"],
            registry=r,
        )
        self.grammar_compile_time = Histogram(
            P + "grammar_compile_seconds",
            "Compile time of a structured-outputs grammar, by kind (cache misses only)",
            ["kind"],
            buckets=_COMPILE_BUCKETS,
            registry=r,
        )
        for kind in STRUCTURED_KINDS:
            self.structured_requests.labels(kind)
            self.grammar_compile_time.labels(kind)

    # -- EngineObserver ----------------------------------------------------------------------

    def on_steps(self, steps: Sequence[StepStats]) -> None:
        self.schedule_time.observe_all([step.schedule_s for step in steps])
        self.forward_time.observe_all([step.execute_s for step in steps])
        self.update_time.observe_all([step.update_s for step in steps])
        if num_tokens := sum(step.num_generated_tokens for step in steps):
            self.generation_tokens.inc(num_tokens)
        if num_out := sum(step.num_blocks_swapped_out for step in steps):
            self.swapped_blocks.labels("out").inc(num_out)
        if num_in := sum(step.num_blocks_swapped_in for step in steps):
            self.swapped_blocks.labels("in").inc(num_in)

    def on_structured_request(self, kind: str, compile_s: float | None) -> None:
        self.structured_requests.labels(kind).inc()
        if compile_s is not None:
            self.grammar_compile_time.labels(kind).observe(compile_s)

    def on_stalled_stream(self) -> None:
        self.stalled_streams.inc()

    def on_request_done(self, request_id: str, output: RequestOutput | None) -> None:
        reason = self._finish_label(request_id, output)
        self.requests_finished.labels(reason).inc()
        if output is None or output.metrics is None:
            return
        m = output.metrics
        if m.first_scheduled_time is not None:
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is None:
            return
        self.ttft.observe(m.first_token_time - m.arrival_time)
        if reason in ("stop", "length") and m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            num_tokens = m.num_output_tokens  # the outputs may be the last delta only
            if num_tokens > 1:
                self.itl.observe((m.finished_time - m.first_token_time) / (num_tokens - 1))

    def _finish_label(self, request_id: str, output: RequestOutput | None) -> str:
        if output is None or output.error is not None or not output.outputs:
            return "error"
        reason = output.outputs[0].finish_reason
        if reason in ("stop", "length", "error"):
            return reason
        abort_reason = self._abort_reason_of(request_id)
        return "cancelled" if abort_reason is None else _ABORT_LABELS[abort_reason]

    # -- the HTTP endpoint -------------------------------------------------------------------

    def start_http(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0: a free port) in a daemon thread; the bound port."""
        self._httpd, self._thread = start_http_server(port, host, registry=self.registry)
        self.port = int(self._httpd.server_port)
        return self.port

    def close(self) -> None:
        """Stop the HTTP endpoint (blocks up to half a second: call it off the event loop)."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
