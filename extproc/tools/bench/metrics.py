"""What a run means in numbers: latency percentiles, throughput, engine queue, fairness. Pure.

Definitions (all times in model seconds, see :mod:`extproc.tools.bench.runner`):

* **TTFT** — from sending the request to its first content token; **e2e** — to
  the end of the response. Percentiles are nearest-rank over successful
  requests.
* **Throughput** — successful requests and output tokens received, divided by
  the makespan: from the first request sent to the last response finished.
  Every arm replays the same plan, so a lower figure means the same work took
  longer to finish. With heavy-tailed lengths the makespan also depends on
  luck: whichever arm happens to start its longest request last finishes
  last. So the headline ratio is **tokens in the common horizon**: output
  tokens received by H, the earliest time any arm of the scenario finished all
  its work, relative to direct FIFO's; an arm that leaves the GPU idle while
  requests wait delivers fewer tokens by H.
* **Engine waiting** — ``vllm:num_requests_waiting`` sampled every 50 ms of
  wall time from the run's start to the last response: median and maximum.
* **Service** of a tenant — ``W_IN`` x prompt tokens (credited when the first
  token arrives, i.e. when prefill is done) plus ``W_OUT`` x output tokens
  (credited evenly between first token and end; the simulator emits them at a
  steady pace), divided by the tenant's weight.
* **Backlogged** — a tenant is backlogged throughout a window if at every
  instant of it at least one of its requests has been sent and has not yet
  received its first token (it waits in a queue, at the gateway or in the
  engine). A tenant whose requests are all streaming is not backlogged: it
  could not use more service than it gets.
* **Jain's index** — for each window of ``JAIN_WINDOW_S`` and each priority
  class in which at least two tenants are backlogged throughout, J =
  (sum x)^2 / (n sum x^2) over those tenants' weighted service x in the
  window; 1 is perfectly even, 1/n is one tenant taking everything. Tenants
  are compared only within their class: strict priority between classes is
  meant to be unfair. Reported: the mean and the minimum over such
  (window, class) pairs, and how many there were.
* **Processor** (arms with extproc) — from the instances' own counters at the
  end of the run, summed over instances: releases per wall-clock second of the
  run, processor CPU per request (ms, all instances), and for a cluster the
  successful Redis round trips per release and the round trip's mean and
  p50/p99 (ms, wall clock; percentiles are the upper bounds of the histogram
  buckets they fall in).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.core.cost import CostWeights
from extproc.tools.bench.runner import ArmRun, EngineSample, Result
from extproc.tools.bench.scenarios import Scenario
from extproc.tools.power_user import percentile

# Cost weights of prompt and output tokens in a tenant's service: the ones the
# `vtc` policy charges by default, so the fairness index measures what it equalises.
W_IN = CostWeights.input_weight
W_OUT = CostWeights.output_weight
JAIN_WINDOW_S = 10.0
PERCENTILES = (50, 95, 99)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p95/p99 (None where there are no values)."""
    return {f"p{q}": (percentile(values, q) if values else None) for q in PERCENTILES}


def latency(results: Iterable[Result]) -> dict[str, object]:
    mine = list(results)
    ok = [r for r in mine if r.ok]
    waits = [r.queue_wait for r in ok if r.queue_wait is not None]
    return {
        "requests": len(mine),
        "ok": len(ok),
        "ttft": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "e2e": percentiles([r.e2e for r in ok]),
        "queue_wait": percentiles(waits) if waits else None,
    }


def grouped(results: Sequence[Result], key: Callable[[Result], str]) -> dict[str, dict[str, object]]:
    groups = sorted({key(r) for r in results})
    return {g: latency(r for r in results if key(r) == g) for g in groups}


@dataclass(frozen=True)
class Throughput:
    makespan: float
    requests_per_s: float
    tokens_per_s: float


def throughput(results: Sequence[Result]) -> Throughput:
    ok = [r for r in results if r.ok]
    if not ok:
        return Throughput(0.0, 0.0, 0.0)
    makespan = max(r.done_at for r in ok) - min(r.sent for r in results)
    return Throughput(makespan, len(ok) / makespan, sum(r.tokens for r in ok) / makespan)


def engine_queue(samples: Sequence[EngineSample], until: float) -> dict[str, float | None]:
    waiting = [s.waiting for s in samples if s.at <= until]
    running = [s.running for s in samples if s.at <= until]
    if not waiting:
        return {"waiting_median": None, "waiting_max": None, "running_mean": None, "samples": 0}
    return {
        "waiting_median": statistics.median(waiting),
        "waiting_max": max(waiting),
        "running_mean": statistics.fmean(running),
        "samples": len(waiting),
    }


def _output_share(result: Result, t: float) -> float | None:
    """The fraction of its output ``result`` had streamed by ``t``; None before its first token."""
    first = result.first_token_at
    if first is None or t < first:
        return None
    span = result.done_at - first
    return 1.0 if span <= 0 else min(1.0, (t - first) / span)


def tokens_until(results: Iterable[Result], t: float) -> float:
    """Output tokens received by time ``t`` (evenly spread between first token and end)."""
    return sum(r.tokens * (_output_share(r, t) or 0.0) for r in results)


def service_until(result: Result, t: float) -> float:
    """Unweighted service ``result`` had delivered by time ``t``."""
    share = _output_share(result, t)
    if share is None:
        return 0.0
    return W_IN * result.prompt_tokens + W_OUT * result.tokens * share


def cumulative_service(
    results: Sequence[Result], tenant: str, times: Sequence[float], weight: float = 1.0
) -> list[float]:
    mine = [r for r in results if r.tenant == tenant]
    return [sum(service_until(r, t) for r in mine) / weight for t in times]


def _merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def backlog_intervals(results: Iterable[Result]) -> list[tuple[float, float]]:
    """When one of ``results`` was waiting for its first token (merged, sorted)."""
    return _merge((r.sent, r.first_token_at if r.first_token_at is not None else r.done_at) for r in results)


def _covers(intervals: Sequence[tuple[float, float]], start: float, end: float) -> bool:
    return any(a <= start and end <= b for a, b in intervals)


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index of non-negative values (1.0 for all-zero)."""
    square_sum = sum(v * v for v in values)
    if square_sum == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * square_sum)


def fairness(
    results: Sequence[Result], weight: Callable[[str], float], window: float = JAIN_WINDOW_S
) -> dict[str, object]:
    """Jain's index over backlogged tenants' weighted service, per window and class (see module docstring)."""
    if not results:
        return {"mean": None, "min": None, "windows": 0}
    flows: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        flows.setdefault((priority_label(r), r.tenant), []).append(r)
    backlog = {flow: backlog_intervals(mine) for flow, mine in flows.items()}
    end = max(r.done_at for r in results)
    indices = []
    for k in range(math.floor(end / window)):
        a, b = k * window, (k + 1) * window
        for cls in sorted({c for c, _ in flows}):
            busy = [f for f in flows if f[0] == cls and _covers(backlog[f], a, b)]
            if len(busy) < 2:
                continue
            served = [sum(service_until(r, b) - service_until(r, a) for r in flows[f]) / weight(f[1]) for f in busy]
            indices.append(jain(served))
    if not indices:
        return {"mean": None, "min": None, "windows": 0}
    return {"mean": statistics.fmean(indices), "min": min(indices), "windows": len(indices)}


def priority_label(result: Result) -> str:
    return result.priority or "default"


def common_horizon(runs: Iterable[ArmRun]) -> float:
    """The earliest time at which one of ``runs`` had finished all its work."""
    return min(throughput(run.results).makespan for run in runs)


def summarize(scenario: Scenario, run: ArmRun, baseline: ArmRun, horizon: float) -> dict[str, Any]:
    """Every figure of one scenario x arm; throughput relative to ``baseline`` (direct FIFO)."""
    results = list(run.results)
    focus = [r for r in results if scenario.in_focus(r.tenant, r.priority)]
    tp = throughput(results)
    base = throughput(baseline.results)
    by_horizon = tokens_until(results, horizon)
    rates: dict[str, float | None] = {
        "makespan_s": tp.makespan,
        "requests_per_s": tp.requests_per_s,
        "tokens_per_s": tp.tokens_per_s,
        "horizon_s": horizon,
        "tokens_by_horizon": by_horizon,
        "requests_ratio": _ratio(tp.requests_per_s, base.requests_per_s),
        "tokens_ratio": _ratio(tp.tokens_per_s, base.tokens_per_s),
        "horizon_tokens_ratio": _ratio(by_horizon, tokens_until(baseline.results, horizon)),
    }
    summary: dict[str, object] = {
        "scenario": scenario.name,
        "arm": run.arm,
        "requests": len(results),
        "ok": sum(r.ok for r in results),
        "errors": sorted({f"{r.status} {r.error[:80]}" for r in results if not r.ok}),
        "focus": latency(focus),
        "all": latency(results),
        "tenants": grouped(results, lambda r: r.tenant),
        "priorities": grouped(results, priority_label),
        "throughput": rates,
        "engine": engine_queue(run.engine, tp.makespan),
        "fairness": fairness(results, scenario.weight),
        "send_lag_max_s": max((r.sent - r.planned for r in results), default=0.0),
        "cpu_share": {name: seconds / run.wall_s for name, seconds in run.cpu_s.items()},
        "wall_s": run.wall_s,
        "processor": processor(run),
    }
    if scenario.reference_before is not None:
        cut = scenario.reference_before
        summary["focus_unloaded"] = latency(r for r in focus if r.sent < cut)
        summary["focus_loaded"] = latency(r for r in focus if r.sent >= cut)
    return summary


def processor(run: ArmRun) -> dict[str, float | None] | None:
    """Releases/s, CPU per request and Redis round trips of the run's processors (None: no processor)."""
    counters = run.processor
    if not counters:
        return None
    released = counters.get("released", 0.0)
    trips = counters.get("round_trip_count", 0.0)
    cpu = run.cpu_s.get("extproc")
    return {
        "released": released,
        "releases_per_s": released / run.wall_s if run.wall_s > 0 else None,
        "cpu_ms_per_request": None if cpu is None or not run.results else cpu * 1e3 / len(run.results),
        "round_trips_per_release": _ratio(counters.get("round_trips_ok", 0.0), released) if trips else None,
        "round_trip_mean_ms": 1e3 * counters.get("round_trip_seconds_sum", 0.0) / trips if trips else None,
        "round_trip_p50_ms": _bucket_quantile(counters, 0.50),
        "round_trip_p99_ms": _bucket_quantile(counters, 0.99),
    }


def _bucket_quantile(counters: dict[str, float], q: float) -> float | None:
    """The upper bound (ms) of the round-trip histogram bucket holding quantile ``q`` (None: no round trips)."""
    prefix = "round_trip_le_"
    buckets = sorted((float(k[len(prefix):]), v) for k, v in counters.items() if k.startswith(prefix))
    if not buckets or buckets[-1][1] <= 0:
        return None
    wanted = q * buckets[-1][1]
    bound = next(le for le, count in buckets if count >= wanted)
    return None if math.isinf(bound) else bound * 1e3


def _ratio(value: float, reference: float) -> float | None:
    return value / reference if reference > 0 else None
