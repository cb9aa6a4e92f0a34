"""Reading an engine's load from its Prometheus ``/metrics`` text, per engine dialect.

Every engine says the same few things under different names: how many
requests wait, how many run, how full the KV cache is, and how long a token
takes. A :class:`EngineDialect` names them; :func:`parse_load` reads them into
one :class:`~extproc.core.values.engine_load.EngineLoad`. The names were checked against each
project's own source (see ``docs/gate.md`` for the file each comes from):

* ``vllm``      vLLM v1 (``vllm/v1/metrics/loggers.py``, checked against a
  running 0.32), with the names of older releases as fallbacks (see the
  dialect's comments).
* ``sglang``    SGLang (``python/sglang/srt/metrics/collector.py``).
* ``tgi``       HuggingFace TGI router (``metrics::gauge!`` calls in the router
  queue/batcher); TGI exposes no KV usage.
* ``llamacpp``  llama.cpp ``llama-server --metrics``; token time from the
  ``tokens_predicted_seconds_total`` / ``tokens_predicted_total`` counters.
* ``trtllm``    TensorRT-LLM ``trtllm-serve`` (``tensorrt_llm/metrics/collector.py``).

Waiting and running are required: without them the gate cannot work and the
scrape counts as failed. KV usage and inter-token latency are optional; an
engine (or version) that lacks them just gives the controller fewer signals.

What an engine says about its prefix cache (read for the locality policy's
account of each endpoint's cache, ``core/prefix_cache.py``) is optional too:
two cumulative counters, prompt tokens looked up and prompt tokens found
cached, and the KV cache's size in tokens. Engines name them differently and
some only have the size, or nothing (the table in ``docs/gate.md``).

Inter-token latency is read as two cumulative counters (a histogram's
``_sum``/``_count``, or llama.cpp's seconds/tokens counters): the controller
takes their deltas over a short window, which is the mean over the tokens
generated *recently*, not since the engine started.

Parsing is prometheus_client's own text parser; we only cut the exposition
down to the families we read first, because a ``/metrics`` page is mostly
histograms we do not need and the scrape runs every 100 ms per endpoint.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from extproc.core.values.engine_load import EngineLoad


class MetricsError(ValueError):
    """The exposition cannot tell us the engine's queue (missing, garbage, wrong model)."""


@dataclass(frozen=True)
class InfoLabels:
    """A number carried in the labels of an info gauge (a gauge fixed at 1, one sample per engine).

    Each candidate is a product of labels, most current first; the first whose
    labels are all numbers is used (a label may read ``"None"`` until the
    engine has sized its cache).
    """

    metric: str
    products: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Counted:
    """A counter's samples that carry all of ``labels``, added up (one reason of several, say)."""

    metric: str
    labels: tuple[tuple[str, str], ...] = ()

    def matches(self, labels: tuple[tuple[str, str], ...]) -> bool:
        return all(pair in labels for pair in self.labels)


@dataclass(frozen=True)
class EngineDialect:
    """Which samples carry each quantity, for one engine.

    Each field lists candidate sample names, most current first; the first one
    present in the exposition is used. ``itl`` pairs are (seconds total, count);
    ``prefix`` pairs are (prompt tokens looked up, prompt tokens found cached),
    read as a pair so the two always come from the same source. Each
    ``kv_capacity`` candidate is a product of samples (tokens, or blocks times
    tokens per block); ``kv_capacity_info`` reads it from an info gauge's
    labels instead, and is tried first.
    ``replica_labels`` mark copies of one quantity (SGLang reports the same
    scheduler gauge once per tensor/pipeline-parallel rank): samples that
    differ only in those labels are not added up.
    """

    waiting: tuple[str, ...]
    running: tuple[str, ...]
    kv_usage: tuple[str, ...] = ()
    itl: tuple[tuple[str, str], ...] = ()
    model_label: str | None = "model_name"
    replica_labels: tuple[str, ...] = ()
    # Cumulative generated-token counter: the cost model's decode rate per sequence.
    generation_tokens: tuple[str, ...] = ()
    # The prefix cache: (queried, hit) token counters, and the KV cache's size in tokens.
    prefix: tuple[tuple[str, str], ...] = ()
    kv_capacity: tuple[tuple[str, ...], ...] = ()
    kv_capacity_info: InfoLabels | None = None
    # Requests the engine refused because its own queue cap was reached: the first candidate present.
    rejected: tuple[Counted, ...] = ()
    # The statuses it answers such a refusal with, before starting the request: Envoy retries them
    # (adapters/envoy/routes.py), and one that reaches the processor cuts the limit instead of marking
    # the endpoint down (release_outcome.py). Empty: the engine has no queue cap.
    full_statuses: frozenset[int] = frozenset()
    # Whether a stream's first event (a JSON object with an "error") is such a refusal, made after the stream's
    # status 200 went out (ext_proc/attach/stream_start.py). None: the engine never refuses a stream so.
    stream_refusal: Callable[[Mapping[str, Any]], bool] | None = None
    # Whether the engine says its queue cap where it says its limits (adapters/engines/limits.py: EngineLimits.max_held).
    says_cap: bool = False
    # What answers whether the process serves (probe.py): vLLM, SGLang, TGI, llama.cpp
    # and trtllm-serve all have GET /health.
    health_path: str = "/health"


def _error_code(*codes: int) -> Callable[[Mapping[str, Any]], bool]:
    """A refusal event in OpenAI's error shape, ``{"error": {"message", "type", "code"}}``, with one of ``codes``."""
    def refused(event: Mapping[str, Any]) -> bool:
        error = event.get("error")
        return isinstance(error, dict) and error.get("code") in codes
    return refused


_TGI_OVERLOADED = "Model is overloaded"  # InferError::Overloaded's message (router/src/infer/mod.rs)


def _tgi_overloaded(event: Mapping[str, Any]) -> bool:
    """TGI's refusal inside a stream: ``{"error": {"message": "Model is overloaded", "http_status_code": 422}}`` on its
    OpenAI routes (``into_openai_event``), ``{"error": "Model is overloaded", "error_type": "overloaded"}`` on its own
    (``impl From<InferError> for Event``), router/src/infer/mod.rs and router/src/server.rs."""
    error = event.get("error")
    if isinstance(error, dict):
        return error.get("message") == _TGI_OVERLOADED
    return event.get("error_type") == "overloaded"


DIALECTS: dict[str, EngineDialect] = {
    "vllm": EngineDialect(
        # Since 0.11 also split by reason (num_requests_waiting_by_reason: capacity,
        # deferred), which adds up to this total.
        waiting=("vllm:num_requests_waiting",),
        running=("vllm:num_requests_running",),
        # gpu_cache_usage_perc: v0 and early v1.
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        itl=(
            # Every gap between two outputs of a running request, observed each step: the
            # inter-token latency clients see while streaming.
            ("vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count"),
            # The same histogram under its name before 0.11 (v0 and v1; hidden in 0.12, gone in 0.13).
            ("vllm:time_per_output_token_seconds_sum", "vllm:time_per_output_token_seconds_count"),
            # Since 0.11: each finished request's mean decode time per token. Observed
            # when a request ends, so it lags by a request; only if the above are missing.
            ("vllm:request_time_per_output_token_seconds_sum", "vllm:request_time_per_output_token_seconds_count"),
        ),
        generation_tokens=("vllm:generation_tokens_total",),
        # Counted when the scheduler first looks a request up (not again when a preempted one resumes).
        prefix=(("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),),
        kv_capacity_info=InfoLabels(
            "vllm:cache_config_info",
            # kv_cache_size_tokens: set once the KV cache is sized (0.32 has it; group-aware, so right for
            # hybrid models too); older releases have only num_gpu_blocks x block_size.
            (("kv_cache_size_tokens",), ("num_gpu_blocks", "block_size")),
        ),
        # Since 0.29, with --max-num-queued-reqs/-tokens set: one series per reason, counted by the API
        # server when it refuses a request (v1/engine/async_llm.py check_admission).
        rejected=(Counted("vllm:admission_rejections_total"),),
        # QueueOverflowError / MaxQueuedTokensError (vllm/exceptions.py), checked before a stream begins.
        full_statuses=frozenset({503}),
        # The same errors when the second check (the request joining the engine) refuses a stream already begun:
        # its generator writes {"error": {..., "code": 503}} as the first event (measured on 0.32, docs/engines.md).
        stream_refusal=_error_code(503),
    ),
    "sglang": EngineDialect(
        waiting=("sglang:num_queue_reqs",),
        running=("sglang:num_running_reqs",),
        kv_usage=("sglang:token_usage",),
        itl=(
            ("sglang:inter_token_latency_seconds_sum", "sglang:inter_token_latency_seconds_count"),
            ("sglang:time_per_output_token_seconds_sum", "sglang:time_per_output_token_seconds_count"),
        ),
        replica_labels=("tp_rank", "pp_rank"),
        generation_tokens=("sglang:generation_tokens_total",),
        # Per finished request, by the tokenizer manager. sglang:cache_hit_rate is a gauge over the last
        # logging interval, which cannot be turned into counters: not read.
        prefix=(("sglang:prompt_tokens_total", "sglang:cached_tokens_total"),),
        kv_capacity=(("sglang:max_total_num_tokens",),),
        # --max-queued-requests: "The request queue is full." (scheduler.py _abort_on_queued_limit); counted
        # by no metric (sglang:num_aborted_requests_total is client aborts).
        full_statuses=frozenset({503}),
        # A stream it refuses gets 200 and {"error": {..., "code": 503}} as its first event
        # (entrypoints/openai/serving_chat.py's stream generator, create_streaming_error_response).
        stream_refusal=_error_code(503),
        says_cap=True,  # /server_info: max_queued_requests
    ),
    "tgi": EngineDialect(
        waiting=("tgi_queue_size",),
        running=("tgi_batch_current_size",),
        # Observed once per finished request (its mean time per token), so it lags.
        itl=(("tgi_request_mean_time_per_token_duration_sum", "tgi_request_mean_time_per_token_duration_count"),),
        model_label=None,
        # --max-concurrent-requests: 429 {"error": "Model is overloaded", "error_type": "overloaded"}, counted
        # under this err label (router/src/infer/mod.rs; the counter has no _total suffix).
        # prometheus_client's parser names a counter's sample *_total whatever the page says.
        rejected=(Counted("tgi_request_failure_total", (("err", "overloaded"),)),),
        full_statuses=frozenset({429}),
        stream_refusal=_tgi_overloaded,
        says_cap=True,  # /info: max_concurrent_requests
    ),
    "llamacpp": EngineDialect(
        waiting=("llamacpp:requests_deferred",),
        running=("llamacpp:requests_processing",),
        # Only older llama-server builds report it.
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
        itl=(("llamacpp:tokens_predicted_seconds_total", "llamacpp:tokens_predicted_total"),),
        model_label=None,
        generation_tokens=("llamacpp:tokens_predicted_total",),
    ),
    "trtllm": EngineDialect(
        waiting=("trtllm_num_requests_waiting",),
        running=("trtllm_num_requests_running",),
        kv_usage=("trtllm_kv_cache_utilization",),
        itl=(("trtllm_time_per_output_token_seconds_sum", "trtllm_time_per_output_token_seconds_count"),),
        # Per finished request, and only with return_perf_metrics: true in the LLM args.
        prefix=(("trtllm_prompt_tokens_total", "trtllm_prompt_cached_tokens_total"),),
        kv_capacity=(("trtllm_kv_cache_max_blocks", "trtllm_kv_cache_tokens_per_block"),),
    ),
}


@functools.cache
def _wanted(dialect: EngineDialect) -> frozenset[str]:
    pairs = [name for pair in (*dialect.itl, *dialect.prefix) for name in pair]
    capacity = [name for product in dialect.kv_capacity for name in product]
    info = [dialect.kv_capacity_info.metric] if dialect.kv_capacity_info else []
    # A counter's sample line may lack the _total its parsed name has (TGI's): keep both spellings.
    rejected = [name for counted in dialect.rejected for name in (counted.metric, counted.metric.removesuffix("_total"))]
    return frozenset((*dialect.waiting, *dialect.running, *dialect.kv_usage, *pairs, *dialect.generation_tokens,
                      *capacity, *info, *rejected))


_SUFFIXES = ("_total", "_sum", "_count", "_bucket")


@functools.cache
def _families(wanted: frozenset[str]) -> frozenset[str]:
    """The names HELP/TYPE lines give the families of ``wanted`` samples (a histogram's has no ``_sum``)."""
    return wanted | {name.removesuffix(suffix) for name in wanted for suffix in _SUFFIXES if name.endswith(suffix)}


def _relevant(text: str, wanted: frozenset[str], info: str | None) -> tuple[str, list[str]]:
    """Only the sample lines we read, and the HELP/TYPE lines of their families; the info gauge's lines apart."""
    keep, info_lines, families = [], [], _families(wanted)
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2] in families:
                keep.append(line)
        else:
            name = line.split("{", 1)[0].split(None, 1)
            if name and name[0] == info:
                info_lines.append(line)
            elif name and name[0] in wanted:
                keep.append(line)
    return "\n".join(keep) + "\n", info_lines


@functools.lru_cache(maxsize=64)
def _info_labels(line: str) -> list[dict[str, str]]:
    """The labels of an info gauge's sample line, parsed once: the line (vLLM's has ~40 labels, a
    quarter of a page's parsing time) stays the same for the life of the engine."""
    return [sample.labels for family in text_string_to_metric_families(line + "\n") for sample in family.samples]


def _combine(values: dict[tuple[tuple[str, str], ...], float], replica_labels: tuple[str, ...], use_max: bool) -> float:
    """One number from a metric's label sets: max over replicas, then sum (or max) over the rest."""
    groups: dict[tuple[tuple[str, str], ...], float] = {}
    for labels, value in values.items():
        key = tuple((k, v) for k, v in labels if k not in replica_labels)
        groups[key] = max(groups.get(key, value), value)
    return max(groups.values()) if use_max else sum(groups.values())


def _first(totals: dict[str, float], names: Iterable[str]) -> float | None:
    return next((totals[n] for n in names if n in totals), None)


def _plausible(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def _product(values: Iterable[float | str | None]) -> float | None:
    """The product of ``values`` if each is a finite positive number (labels are text), else None."""
    result = 1.0
    for value in values:
        try:
            number = float(value) if value is not None else math.nan
        except ValueError:
            return None
        if not (math.isfinite(number) and number > 0):
            return None
        result *= number
    return result


def _info_value(info: InfoLabels, labels: dict[str, str]) -> float | None:
    return next((v for p in info.products if (v := _product(labels.get(name) for name in p)) is not None), None)


def _capacity(dialect: EngineDialect, totals: dict[str, float]) -> float | None:
    if dialect.kv_capacity_info and dialect.kv_capacity_info.metric in totals:
        return totals[dialect.kv_capacity_info.metric]
    return next((v for p in dialect.kv_capacity if (v := _product(totals.get(name) for name in p)) is not None), None)


def parse_load(engine: str, text: str, model: str) -> EngineLoad:
    """The load that ``text`` reports for ``model`` (raises :class:`MetricsError`).

    Samples of other models on the same endpoint are ignored; samples without
    the model label count (a single-model engine may omit it). Counts add up
    over label sets (vLLM's data-parallel ``engine`` label); KV usage takes the
    fullest one.
    """
    dialect = DIALECTS[engine]
    wanted, info = _wanted(dialect), dialect.kv_capacity_info
    by_name: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}

    def add(name: str, labels: dict[str, str], value: float | None) -> None:
        if value is not None and not (dialect.model_label and labels.get(dialect.model_label, model) != model):
            by_name.setdefault(name, {})[tuple(sorted(labels.items()))] = value

    try:
        kept, info_lines = _relevant(text, wanted, info.metric if info else None)
        for family in text_string_to_metric_families(kept):
            for sample in family.samples:
                if sample.name in wanted:
                    add(sample.name, sample.labels, sample.value)
        if info:  # the number is in the labels
            for line in info_lines:
                for labels in _info_labels(line):
                    add(info.metric, labels, _info_value(info, labels))
    except ValueError as exc:
        raise MetricsError(f"unparseable metrics: {exc}") from exc
    kv_names = set(dialect.kv_usage)
    totals = {
        name: _combine(values, dialect.replica_labels, use_max=name in kv_names) for name, values in by_name.items()
    }
    rejected = _counted(by_name, dialect.rejected, dialect.replica_labels)
    waiting, running = _first(totals, dialect.waiting), _first(totals, dialect.running)
    if waiting is None or running is None:
        missing = dialect.waiting[0] if waiting is None else dialect.running[0]
        raise MetricsError(f"no {missing} for model {model!r}")
    if _plausible(waiting) is None or _plausible(running) is None:  # NaN or negative: not a queue length
        raise MetricsError(f"implausible values waiting={waiting} running={running}")
    itl_sum, itl_count = _pair(totals, dialect.itl)
    queries, hits = _pair(totals, dialect.prefix)
    return EngineLoad(
        waiting=waiting,
        running=running,
        kv_usage=_plausible(_first(totals, dialect.kv_usage)),
        itl_sum=itl_sum,
        itl_count=itl_count,
        generation_tokens=_plausible(_first(totals, dialect.generation_tokens)),
        prefix_queries=queries,
        prefix_hits=hits,
        kv_capacity_tokens=_capacity(dialect, totals),
        rejected=_plausible(rejected),
    )


def _counted(
    by_name: dict[str, dict[tuple[tuple[str, str], ...], float]], candidates: tuple[Counted, ...],
    replica_labels: tuple[str, ...],
) -> float | None:
    """The first candidate counter present, its matching label sets added up."""
    for counted in candidates:
        values = {labels: v for labels, v in by_name.get(counted.metric, {}).items() if counted.matches(labels)}
        if values:
            return _combine(values, replica_labels, use_max=False)
    return None


def _pair(totals: dict[str, float], pairs: tuple[tuple[str, str], ...]) -> tuple[float | None, float | None]:
    """The first pair of counters both present, each None if implausible; both None unless both are read."""
    for first, second in pairs:
        if first in totals and second in totals:
            a, b = _plausible(totals[first]), _plausible(totals[second])
            return (a, b) if a is not None and b is not None else (None, None)
    return None, None
