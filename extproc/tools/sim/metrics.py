"""vLLM's Prometheus metrics, fed by the simulated engine.

Names, HELP texts, label names and histogram buckets are transcribed from
vLLM's ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``), so
dashboards, recording rules and the fair scheduler's scraper see what a real
vLLM v1 server exposes. Only the subset that the simulator can fill honestly is
defined. Each simulator gets its own ``CollectorRegistry`` so several can run
in one process.

Differences worth knowing:

* Timings are wall-clock seconds as the simulator experienced them, so with
  ``time_scale=0.1`` every latency is about ten times smaller than the
  simulated GPU time.
* The running and waiting gauges show the scheduler as of the end of its last
  step (vLLM sets them from each step's stats), so a request that arrives
  while a step runs is not counted as waiting; an abort shows at once. The KV
  usage gauge is read at scrape time.
* A request aborted because its client went away is counted nowhere, as in
  vLLM 0.32: ``AsyncLLM.abort`` (``vllm/v1/engine/async_llm.py``) drops the
  request from ``OutputProcessor.abort_requests``
  (``vllm/v1/engine/output_processor.py``) before any of its stats are
  recorded, and the engine core's ``Scheduler.finish_requests`` emits no
  output for it. So ``vllm:request_success_total{finished_reason="abort"}``
  exists (vLLM pre-creates a series per finish reason) but stays 0; only the
  gauges show the abort (the request leaves ``num_requests_running`` or
  ``num_requests_waiting`` and its KV is freed).
* Preemptions (``kv_mode="incremental"``) count in ``vllm:num_preemptions_total``
  when they happen, and each finished request observes how often it was
  preempted in ``vllm:request_num_preemptions`` (vLLM's
  ``IterationStats.update_from_events`` and ``update_from_finished_request``,
  ``vllm/v1/metrics/stats.py``).
* The prefix cache (``--prefix-caching``): ``vllm:prefix_cache_queries_total``
  counts every prompt token of each request when it is first admitted and
  ``vllm:prefix_cache_hits_total`` those found cached, as vLLM's
  ``Scheduler.schedule`` records them ("Record at admission so unscheduled
  lookups are not counted": ``record_prefix_cache_stats`` with
  ``request.num_tokens``, skipping resumed requests, whose ``preempted_*``
  stats no counter shows). Without prefix caching both stay 0 (vLLM skips
  the lookup). ``vllm:cache_config_info`` is vLLM's info gauge
  (``PrometheusStatLogger.log_metrics_info``, labelled with the
  ``CacheConfig`` fields), here with the fields the simulator has:
  ``block_size``, ``enable_prefix_caching``, ``engine``,
  ``kv_cache_size_tokens`` and ``num_gpu_blocks``. vLLM's pool holds one
  block no request can use (``BlockPool.null_block``), which
  ``num_gpu_blocks`` and ``kv_cache_size_tokens`` count, so the simulator
  reports its capacity plus one block: ``(num_gpu_blocks - 1) * block_size``
  is the usable KV of both. The KV usage gauge counts cached but free blocks
  as free, as vLLM's ``BlockPool.get_usage``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.tools.sim.engine import FINISH_ABORT, Scheduler, SimRequest, TokenEvent

# vllm/v1/metrics/loggers.py ADMISSION_REASONS.
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
# vllm/v1/engine/__init__.py FINISH_REASON_STRINGS; vLLM pre-creates a series per reason.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

_LABELS = ["model_name", "engine"]
_ENGINE_INDEX = "0"

_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]
_ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]
# vllm/v1/metrics/buckets.py REQUEST_NUM_PREEMPTIONS_BUCKETS, as a 0.32 server exposes them.
_PREEMPTIONS_BUCKETS = [1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0]
_REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]


class VllmMetrics:
    """Implements ``EngineObserver`` by updating vLLM-named Prometheus metrics."""

    def __init__(self, model_name: str, scheduler: Scheduler) -> None:
        self.registry = CollectorRegistry()
        labels = (model_name, _ENGINE_INDEX)

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, _LABELS, registry=self.registry)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, _LABELS, registry=self.registry).labels(*labels)

        def histogram(name: str, documentation: str, buckets: list[float]) -> Histogram:
            return Histogram(
                name, documentation, _LABELS, registry=self.registry, buckets=buckets
            ).labels(*labels)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.").labels(
            *labels
        ).set_function(lambda: scheduler.shown_running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.").labels(
            *labels
        ).set_function(lambda: scheduler.shown_waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.").labels(
            *labels
        ).set_function(lambda: scheduler.kv_usage)

        num_blocks = scheduler.kv_capacity // scheduler.block_size + 1  # and vLLM's null block
        cache_config = {
            "block_size": str(scheduler.block_size),
            "enable_prefix_caching": str(scheduler.prefix_caching),
            "engine": _ENGINE_INDEX,
            "kv_cache_size_tokens": str(num_blocks * scheduler.block_size),
            "num_gpu_blocks": str(num_blocks),
        }
        Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(cache_config),
            registry=self.registry,
        ).labels(**cache_config).set(1)

        # prometheus_client appends "_total" to counter names on exposition.
        self._preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self._prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self._prefix_caching = scheduler.prefix_caching
        self._prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self._prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self._generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*_LABELS, "finished_reason"],
            registry=self.registry,
        )
        self._success = {reason: success.labels(*labels, reason) for reason in FINISH_REASONS}
        # vLLM >= 0.29 (loggers.py "Frontend admission"): labelled by model and reason only, both reasons
        # pre-created whether or not a cap is set.
        admission = Counter(
            "vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"], registry=self.registry,
        )
        self._admission_rejections = {reason: admission.labels(model_name, reason) for reason in ADMISSION_REASONS}

        self._ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )
        self._itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self._queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self._request_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            _PREEMPTIONS_BUCKETS,
        )

    def on_scheduled(self, request: SimRequest) -> None:
        self._prompt_tokens.inc(request.prompt_tokens)
        if self._prefix_caching:
            self._prefix_queries.inc(request.num_tokens)
            self._prefix_hits.inc(request.num_cached_tokens)

    def on_token(self, event: TokenEvent) -> None:
        self._generation_tokens.inc()
        (self._ttft if event.index == 0 else self._itl).observe(event.since_previous)

    def on_preempted(self, request: SimRequest) -> None:
        self._preemptions.inc()

    def on_rejected(self, reason: str) -> None:
        self._admission_rejections[reason].inc()

    def on_finished(self, request: SimRequest) -> None:
        reason = request.finish_reason
        assert reason is not None, "on_finished called for a live request"
        if reason == FINISH_ABORT:
            return  # a client that left is counted nowhere (see the module docstring)
        self._success[reason].inc()
        assert request.scheduled_at is not None and request.last_token_at is not None
        self._queue.observe(request.scheduled_at - request.arrival)
        self._e2e.observe(request.last_token_at - request.arrival)
        self._request_preemptions.observe(request.num_preemptions)
