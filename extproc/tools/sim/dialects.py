"""The simulator's ``/metrics`` in other engines' dialects (``extproc-dev sim --dialect``).

The vLLM dialect is :class:`extproc.tools.sim.metrics.VllmMetrics`. The others
expose the subset of each engine's metrics the gate reads, with that engine's
names, label sets and histogram buckets (sources and a captured page of each
are in ``tests/fixtures/metrics/``), fed by the same simulated engine:

* ``sglang``   per-rank scheduler gauges (``model_name``, ``engine_type``,
  ``tp_rank``, ``pp_rank``) and a per-token inter-token latency histogram;
* ``tgi``      unlabelled router gauges; time per token is observed once per
  finished request (its mean), in TGI's geometric ``*_duration`` buckets;
* ``llamacpp`` unlabelled gauges and counters; token time accumulates when a
  request ends, as llama-server's slot metrics do;
* ``trtllm``   ``model_name``/``engine_type`` labels; time per output token
  observed per finished request, in vLLM's buckets (TensorRT-LLM copied them).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.adapters.protocol.dialects import DIALECTS
from extproc.tools.sim.engine import FINISH_ABORT, Scheduler, SimRequest, TokenEvent

# Every dialect the gateway reads; each needs its branch below (tests/adapters/engines/test_engines.py checks that it speaks).
DIALECT_NAMES = tuple(DIALECTS)

# sglang/srt/metrics/collector.py TokenizerMetricsCollector defaults.
_SGLANG_ITL_BUCKETS = [
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
    0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
]
# TGI router: Matcher::Suffix("duration"), 35 buckets, value *= 1.5 from 0.0001.
_TGI_DURATION_BUCKETS = [0.0001 * 1.5**k for k in range(1, 36)]
# tensorrt_llm/metrics/collector.py time_per_output_token defaults.
_TRTLLM_TPOT_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]


def _mean_token_time(request: SimRequest) -> float | None:
    """(last token - first token) / (tokens - 1): what TGI and TRT-LLM observe per request."""
    if request.num_generated < 2 or request.first_token_at is None or request.last_token_at is None:
        return None
    return (request.last_token_at - request.first_token_at) / (request.num_generated - 1)


class DialectMetrics:
    """``EngineObserver`` exposing another engine's metric names (see module docstring)."""

    def __init__(self, dialect: str, model_name: str, scheduler: Scheduler) -> None:
        if dialect not in DIALECT_NAMES or dialect == "vllm":
            raise ValueError(f"no simulated dialect {dialect!r} here (vllm is VllmMetrics)")
        self.dialect = dialect
        self.registry = r = CollectorRegistry()

        def waiting() -> float:
            return scheduler.shown_waiting  # as of the last step's end, as VllmMetrics

        def running() -> float:
            return scheduler.shown_running

        def kv() -> float:
            return scheduler.kv_usage

        self._itl: Histogram | None = None
        self._per_request: Histogram | None = None
        self._tokens: Counter | None = None
        self._token_seconds: Counter | None = None
        if dialect == "sglang":
            labels = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
            for name, doc, fn in (
                ("sglang:num_running_reqs", "The number of running requests.", running),
                ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", waiting),
                ("sglang:token_usage", "The token usage.", kv),
            ):
                Gauge(name, doc, list(labels), registry=r).labels(**labels).set_function(fn)
            self._itl = Histogram(
                "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                ["model_name"], buckets=_SGLANG_ITL_BUCKETS, registry=r,
            ).labels(model_name)
        elif dialect == "tgi":
            Gauge("tgi_queue_size", "Current queue size", registry=r).set_function(waiting)
            Gauge("tgi_batch_current_size", "Current batch size", registry=r).set_function(running)
            self._per_request = Histogram(
                "tgi_request_mean_time_per_token_duration", "Mean time per token per request (inter-token latency)",
                buckets=_TGI_DURATION_BUCKETS, registry=r,
            )
        elif dialect == "llamacpp":
            self._tokens = Counter("llamacpp:tokens_predicted", "Number of generation tokens processed", registry=r)
            self._token_seconds = Counter(
                "llamacpp:tokens_predicted_seconds", "Total time spent generating tokens", registry=r
            )
            Gauge("llamacpp:requests_processing", "Number of requests processing", registry=r).set_function(running)
            Gauge("llamacpp:requests_deferred", "Number of requests deferred", registry=r).set_function(waiting)
        elif dialect == "trtllm":
            labels = {"model_name": model_name, "engine_type": "trtllm"}
            for name, doc, fn in (
                ("trtllm_num_requests_running", "Number of active requests", running),
                ("trtllm_num_requests_waiting", "Number of queued requests", waiting),
                ("trtllm_kv_cache_utilization", "KV cache utilization", kv),
            ):
                Gauge(name, doc, list(labels), registry=r).labels(**labels).set_function(fn)
            self._per_request = Histogram(
                "trtllm_time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                list(labels), buckets=_TRTLLM_TPOT_BUCKETS, registry=r,
            ).labels(**labels)
        else:
            raise ValueError(f"the simulator does not speak the {dialect!r} dialect yet (add it here)")

    def on_scheduled(self, request: SimRequest) -> None:
        pass

    def on_token(self, event: TokenEvent) -> None:
        if self._itl is not None and event.index > 0:
            self._itl.observe(event.since_previous)

    def on_preempted(self, request: SimRequest) -> None:
        pass

    def on_rejected(self, reason: str) -> None:
        pass  # the simulator's caps are vLLM's; other dialects' pages do not count them

    def on_finished(self, request: SimRequest) -> None:
        if request.finish_reason == FINISH_ABORT:
            return
        mean = _mean_token_time(request)
        if self._per_request is not None and mean is not None:
            self._per_request.observe(mean)
        if self._tokens is not None and self._token_seconds is not None and mean is not None:
            self._tokens.inc(request.num_generated - 1)
            self._token_seconds.inc(mean * (request.num_generated - 1))
