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
  The engine's step over the run: its mean inter-token latency
  (``vllm:inter_token_latency_seconds``), which shows a CPU slowed by other work.
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
* **Versus unloaded** — the focus group's TTFT p50 and p99 during the
  disturbance divided by the same percentile unloaded: the scenario's
  ``UNLOADED`` phase (the same requests replayed alone on the same arm's
  stack first) where it has one, else its requests sent before
  ``reference_before``.
* **Objective attainment** — the share of a class's requests (failed ones
  included) whose TTFT met the class's objective, as the arm's processor
  resolved it (``ttft_objective_s``; direct FIFO is held to the same).
* **Batch** — the batch class's makespan (its first send to its last answer),
  its output tokens per second over it, and that against the *idle
  capacity*: what the engine did with the batch alone (the ``BATCH_ALONE``
  phase, straight to the engine) times the share of its slots the others
  left free (what they held of slots x the batch's makespan, each request
  from its first token to its end); also per engine step
  (each rate times the engine's mean inter-token latency then), which a CPU
  busy with other work does not change. Preemptions per batch
  request: the client's count of 503 ``preempted`` answers, and the
  processor's ``extproc_preemptions_total`` where it exports one.
* **Classes** — each class's TTFT p50/p99 and output tokens per second over
  its own makespan, divided by direct FIFO's for the same class.
* **Work conservation** — the engine's running requests
  (``vllm:num_requests_running``, as sampled) averaged over time across the
  batch's makespan, against direct FIFO's; and where a gap comes from: the
  time from a completion to the release that refilled its slot (the k-th
  completion's slot is refilled by the (k + slots)-th release; releases at
  the processor's clock, from its decision log), and the engine's empty slots
  (slots - running) integrated over the time the gateway held a batch
  request (sent, not yet released: the answered attempt's send + its
  queue-wait header), in all, before the engine first ran all its slots
  (the start), and per completion in that time; and over the whole
  makespan for every arm (direct too), so the gateway's excess over direct
  shows what it adds. The makespan
  is also given in engine steps (divided by the engine's mean inter-token
  latency over it), which a CPU busy with other work does not lengthen.
* **Idle slot-seconds while held** (arms with extproc, every scenario) — the
  engine's empty slots (slots - running, as sampled) integrated over the time
  in which the gateway held at least one request of any class: each request's
  time in the processor's queue from its decision log (the decision's time less
  its ``wait_ms``), else from the client's send to its release (the queue-wait
  header). Also as a share of the engine's slot-seconds over the run (its start
  to its last answer, or its window). Where there are several engine replicas,
  the first one's.
* **Trace replay** (``TRACE``: a scenario with a window) — per class: requests
  not answered in the window (cut before their first token, or while
  streaming), TTFT p50/p99 with a request that got no first token counted as
  later than any (a percentile that falls among them is past the window),
  output tokens received by the end of the window (a cut stream's count) against
  direct FIFO's, and the requests that missed the class's TTFT objective (no
  first token within it, in the window); and the processor's own count
  (``extproc_objective_requests_total``: released late, or left the queue once
  the deadline had passed); the worst-served tenant of each class (the
  largest TTFT p99 of its tenants). The focus class's TTFT p99 against the same
  requests alone on a quiet engine (the baseline's ``UNLOADED`` phase), and the
  offered load as measured: the engine's mean running / slots over the replayed
  span with the trace alone (the ``TRACE_ALONE`` phase) and the chats alone,
  against what the replay computed.
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.core.cost import CostWeights
from extproc.tools.bench.runner import ArmRun, EngineSample, Result
from extproc.tools.bench.scenarios import (
    BATCH,
    BATCH_ALONE,
    CLASSES,
    CONSERVATION,
    LOCALITY,
    OBJECTIVES,
    TRACE,
    TRACE_ALONE,
    UNLOADED,
    Scenario,
)
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


# The VTC artifact's fairness table (fair_bench/plot/plot_6.2_work_diff.py): 60 s windows at 19 ticks over a
# ~10 min run; ours are ~1 min runs, so the window is scaled to 10 s (ticks stay 19).
SERVICE_DIFF_WINDOW_S = 10.0
SERVICE_DIFF_TICKS = 20


def service_difference(
    results: Sequence[Result], weight: Callable[[str], float], window: float = SERVICE_DIFF_WINDOW_S,
    ticks: Sequence[float] | None = None,
) -> dict[str, float | None]:
    """The VTC paper's service difference (Sheng et al., OSDI 2024), as its artifact computes it: its max and mean.

    At each tick x, over the window [x - window/2, x + window/2], a tenant's
    service rate is the cost (``W_IN`` x prompt + ``W_OUT`` x output tokens,
    the paper's 1 and 2) of its answers, each spread evenly from its first
    token to its end, that falls in the window, per second; its demand rate the
    cost of its requests sent in the window. The tick's difference is the
    largest, over tenants, of min(the best-served tenant's rate - its rate, its
    demand - its rate): a tenant short of the best is unfairly served only as
    far as it asked for more. Rates are divided by the tenant's weight.
    ``ticks``: by default 19, evenly spaced in (0, last send). Service units per
    second; lower is fairer. (An answer with no streaming span counts at its end.)
    """
    tenants = sorted({r.tenant for r in results})
    if ticks is None:
        last = max((r.sent for r in results), default=0.0)
        ticks = [last * k / SERVICE_DIFF_TICKS for k in range(1, SERVICE_DIFF_TICKS)]
    if len(tenants) < 2 or not ticks:
        return {"mean": None, "max": None, "ticks": 0}
    gaps = []
    for x in ticks:
        lo, hi = x - window / 2, x + window / 2
        rate = {t: 0.0 for t in tenants}
        demand = {t: 0.0 for t in tenants}
        for r in results:
            cost = W_IN * r.prompt_tokens + W_OUT * r.tokens
            if lo <= r.sent <= hi:
                demand[r.tenant] += cost
            if (first := r.first_token_at) is None:
                continue
            span = r.done_at - first
            share = (max(0.0, min(hi, r.done_at) - max(lo, first)) / span if span > 0
                     else float(lo <= r.done_at <= hi))
            rate[r.tenant] += cost * share
        served = {t: rate[t] / window / weight(t) for t in tenants}
        asked = {t: demand[t] / window / weight(t) for t in tenants}
        best = max(served.values())
        gaps.append(max(min(best - served[t], asked[t] - served[t]) for t in tenants))
    return {"mean": statistics.fmean(gaps), "max": max(gaps), "ticks": len(gaps)}


def prefix_hits(run: ArmRun) -> dict[str, Any]:
    """The engines' prefix-cache hit rate over the run (hit tokens / queried tokens, every replica), the tokens, and
    each replica's share of the queried tokens (how evenly the arm spread the prompts)."""
    queries, hits = run.prefix_cache.get("queries"), run.prefix_cache.get("hits")
    rate = hits / queries if queries and hits is not None else None
    shares = [q / queries for q in run.replica_queries] if queries else []
    return {"hit_rate": rate, "queried_tokens": queries, "hit_tokens": hits, "replica_shares": shares}


def priority_label(result: Result) -> str:
    return result.priority or "default"


def common_horizon(runs: Iterable[ArmRun]) -> float:
    """The earliest time at which one of ``runs`` had finished all its work."""
    return min(throughput(run.results).makespan for run in runs)


def summarize(
    scenario: Scenario, run: ArmRun, baseline: ArmRun, horizon: float, *, batch_alone: Capacity | None = None
) -> dict[str, Any]:
    """Every figure of one scenario x arm; throughput relative to ``baseline`` (direct FIFO).

    ``batch_alone``: what the engine did with the batch alone, straight to it
    (:func:`batch_capacity`), for the idle capacity.
    """
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
        "engine": {**engine_queue(run.engine, tp.makespan), "itl_ms": _ms(itl_between(run.engine, 0.0, tp.makespan))},
        "fairness": fairness(results, scenario.weight),
        "send_lag_max_s": max((r.sent - r.planned for r in results), default=0.0),
        "cpu_share": {name: seconds / run.wall_s for name, seconds in run.cpu_s.items()},
        "wall_s": run.wall_s,
        "processor": processor(run),
        "idle_while_held": idle_while_held(run, scenario.window) if run.processor else None,
    }
    if UNLOADED in run.phases:
        summary["focus_unloaded"] = latency(r for r in run.phases[UNLOADED].results
                                            if scenario.in_focus(r.tenant, r.priority))
        summary["focus_loaded"] = latency(focus)
    elif scenario.reference_before is not None:
        cut = scenario.reference_before
        summary["focus_unloaded"] = latency(r for r in focus if r.sent < cut)
        summary["focus_loaded"] = latency(r for r in focus if r.sent >= cut)
    if OBJECTIVES in scenario.measures:
        loaded = [r for r in focus if scenario.reference_before is None or r.sent >= scenario.reference_before]
        summary["slowdown"] = slowdown(summary.get("focus_loaded"), summary.get("focus_unloaded"))
        summary["focus_objective"] = attainment(loaded, run.objectives.get(scenario.focus_priority or ""))
        summary["objectives"] = {
            cls: attainment([r for r in results if priority_label(r) == cls], objective)
            for cls, objective in run.objectives.items() if any(priority_label(r) == cls for r in results)
        }
    if BATCH in scenario.measures:
        summary["batch"] = batch_figures(scenario, run, baseline, batch_alone)
    if CLASSES in scenario.measures:
        summary["classes"] = class_figures(results, list(baseline.results))
    if CONSERVATION in scenario.measures:
        summary["conservation"] = conservation(scenario, run, baseline)
    if LOCALITY in scenario.measures:
        summary["locality"] = {**prefix_hits(run), "service_difference": service_difference(results, scenario.weight)}
    if TRACE in scenario.measures:
        summary["trace"] = trace_figures(scenario, run, baseline)
    return summary


# --- the gateway's idle slots; a trace replayed in a window ----------------------------------------------------


def gateway_held(run: ArmRun) -> list[tuple[float, float]]:
    """When the gateway held at least one request (any class): from the decision log, else the clients' headers.

    A logged decision at t after ``waited`` held its request over [t - waited, t];
    a request the run abandoned at its window's end is logged as it leaves.
    """
    logged = [(d.at - d.waited, d.at) for d in run.decisions if d.waited]
    return _merge(logged) if logged else held_intervals(run.results)


def run_end(run: ArmRun, window: float | None) -> float:
    """The end of what a run is measured over: its window, else its last answer."""
    return window if window is not None else max((r.done_at for r in run.results), default=0.0)


def idle_while_held(run: ArmRun, window: float | None = None) -> dict[str, float | None]:
    """The engine's empty slot-seconds while the gateway held requests, over the run (or its ``window``).

    ``share``: of the engine's slot-seconds over it (slots x its length).
    """
    end = run_end(run, window)
    held = [(max(0.0, a), min(b, end)) for a, b in gateway_held(run) if b > 0 and a < end]
    empty = empty_slots_while_held(run.engine, held, run.slots)
    capacity = run.slots * end
    return {"held_s": sum(b - a for a, b in held), "below_slots_s": empty["below_s"], "slot_s": empty["slot_s"],
            "over_s": end, "share": empty["slot_s"] / capacity if capacity > 0 else None}


def ttft_in_window(results: Sequence[Result]) -> dict[str, Any]:
    """TTFT p50/p99 of ``results``, a request without a first token counted as later than any.

    Nearest rank over all of them: a percentile that falls among those
    without a first token is None, and named in ``beyond`` (it is past the
    window, or the request failed).
    """
    got = sorted(r.ttft for r in results if r.ttft is not None)
    figures: dict[str, Any] = {"beyond": []}
    for q in (50, 99):
        rank = max(1, math.ceil(q / 100 * len(results)))
        figures[f"p{q}"] = got[rank - 1] if results and rank <= len(got) else None
        if results and rank > len(got):
            figures["beyond"].append(f"p{q}")
    return figures


def missed_objective(results: Iterable[Result], objective_s: float | None) -> int | None:
    """How many of ``results`` had no first token within ``objective_s`` (answered late, or not at all)."""
    if objective_s is None:
        return None
    return sum(not (r.ttft is not None and r.ttft <= objective_s) for r in results)


def trace_class(mine: Sequence[Result], direct: Sequence[Result], window: float, objective_s: float | None,
                counters: Mapping[str, float], cls: str) -> dict[str, Any]:
    """One class of a trace replay in its window, against the same class straight to the engine (see the docstring)."""
    tokens, base = tokens_until(mine, window), tokens_until(direct, window)
    answered = sum(r.ok for r in mine)
    by_tenant = {t: ttft_in_window([r for r in mine if r.tenant == t])["p99"] for t in sorted({r.tenant for r in mine})}
    # The worst-served tenant: the largest TTFT p99 (None, a p99 past the window, is the worst of all).
    worst = max(by_tenant, key=lambda t: math.inf if by_tenant[t] is None else by_tenant[t], default=None)
    return {
        "requests": len(mine),
        "answered": answered,
        "not_answered": len(mine) - answered,
        "cut_waiting": sum(r.cut and r.ttft is None for r in mine),
        "cut_streaming": sum(r.cut and r.ttft is not None for r in mine),
        "failed": sum(not r.ok and not r.cut for r in mine),
        "ttft": ttft_in_window(mine),
        "tokens": tokens,
        "tokens_vs_direct": _ratio(tokens, base),
        "objective_s": objective_s,
        "missed": missed_objective(mine, objective_s),
        "processor_met": counters.get(f"objective_{cls}_met"),
        "processor_missed": counters.get(f"objective_{cls}_missed"),
        "worst_tenant": None if worst is None else {"tenant": worst, "p99": by_tenant[worst]},
    }


def trace_figures(scenario: Scenario, run: ArmRun, baseline: ArmRun) -> dict[str, Any]:
    """A replayed trace in its window: each class, the focus class against the quiet engine, the offered load."""
    window = run_end(run, scenario.window)
    results, direct = list(run.results), list(baseline.results)
    classes = {
        cls: trace_class([r for r in results if priority_label(r) == cls],
                         [r for r in direct if priority_label(r) == cls], window, run.objectives.get(cls),
                         run.processor, cls)
        for cls in sorted({priority_label(r) for r in results})
    }
    tokens, base = tokens_until(results, window), tokens_until(direct, window)
    mine = ttft_in_window([r for r in results if scenario.in_focus(r.tenant, r.priority)])
    quiet_run = baseline.phases.get(UNLOADED)
    quiet = None if quiet_run is None else latency(
        r for r in quiet_run.results if scenario.in_focus(r.tenant, r.priority))
    quiet_p99 = _get_ttft(quiet, "p99")
    figures: dict[str, Any] = {
        "window_s": window,
        "classes": classes,
        "tokens": tokens,
        "tokens_vs_direct": _ratio(tokens, base),
        "focus_reference": {"quiet_p50": _get_ttft(quiet, "p50"), "quiet_p99": quiet_p99, "p99": mine["p99"],
                            "p99_vs_quiet": _maybe_ratio(mine["p99"], quiet_p99)},
    }
    if run is baseline:
        figures["offered"] = offered_load(scenario, baseline)
    return figures


def _get_ttft(block: Mapping[str, Any] | None, q: str) -> float | None:
    value = None if block is None else block["ttft"][q]
    return None if value is None or math.isnan(value) else float(value)


def offered_load(scenario: Scenario, baseline: ArmRun) -> dict[str, float | None]:
    """The replay's offered utilisation as computed, and as measured: the engine's mean running / slots over the span.

    With the trace alone (``TRACE_ALONE``) and with the chats alone (``UNLOADED``), straight to the engine.
    """
    replay, span = scenario.replay, scenario.replay.get("span_s")

    def measured(phase: str) -> float | None:
        run = baseline.phases.get(phase)
        if run is None or not span or not baseline.slots:
            return None
        mean = time_mean(run.engine, 0.0, span)
        return None if mean is None else mean / baseline.slots

    chats = replay.get("kinds", {}).get("conv", {}).get("offered_utilisation")
    return {"expected": replay.get("offered_utilisation"), "measured": measured(TRACE_ALONE),
            "chats_expected": chats, "chats_measured": measured(UNLOADED)}


# --- priority inside the engine: objectives, the batch class, classes against direct, work conservation ----------------


def slowdown(loaded: Any, unloaded: Any) -> dict[str, float | None]:
    """TTFT p50 and p99 of ``loaded`` over ``unloaded`` (latency blocks; None where either is missing)."""

    def pct(block: Any, q: str) -> float | None:
        value = block["ttft"][q] if isinstance(block, dict) else None
        return None if value is None or math.isnan(value) else float(value)

    return {q: _maybe_ratio(pct(loaded, q), pct(unloaded, q)) for q in ("p50", "p99")}


def attainment(results: Sequence[Result], objective_s: float | None) -> dict[str, float | None]:
    """How many of ``results`` got their first token within ``objective_s`` (a failed request did not)."""
    if objective_s is None or not results:
        return {"objective_s": objective_s, "requests": len(results), "met": None, "share": None}
    met = sum(r.ok and r.ttft is not None and r.ttft <= objective_s for r in results)
    return {"objective_s": objective_s, "requests": len(results), "met": met, "share": met / len(results)}


@dataclass(frozen=True)
class Capacity:
    """What the engine did with the batch alone: output tokens per second, and its mean step then (None: unknown)."""

    tokens_per_s: float
    itl_s: float | None = None


def _span(results: Sequence[Result]) -> tuple[float, float] | None:
    """From the first send to the last answer of the successful ``results``."""
    ok = [r for r in results if r.ok]
    return (min(r.sent for r in ok), max(r.done_at for r in ok)) if ok else None


def batch_capacity(scenario: Scenario, baseline: ArmRun) -> Capacity | None:
    """The batch alone straight to the engine (its BATCH_ALONE phase): tokens per second and the engine's step."""
    phase = baseline.phases.get(BATCH_ALONE)
    if phase is None:
        return None
    batch = [r for r in phase.results if r.priority == scenario.batch_priority]
    rate, span = throughput(batch).tokens_per_s, _span(batch)
    if not rate or span is None:
        return None
    return Capacity(rate, itl_between(phase.engine, *span))


def slot_share(results: Iterable[Result], span: tuple[float, float], slots: int) -> float | None:
    """The share of ``slots`` x ``span`` that ``results`` held: each from its first token to its end.

    From the first token, not the send: a request waiting for a slot holds
    none (its prefill step is left out, so this errs low).
    """
    length = span[1] - span[0]
    if slots <= 0 or length <= 0:
        return None
    held = sum(_overlap(first, r.done_at, [span]) for r in results if (first := r.first_token_at) is not None)
    return held / (slots * length)


def batch_figures(
    scenario: Scenario, run: ArmRun, baseline: ArmRun, alone: Capacity | None
) -> dict[str, float | None]:
    """The batch class's makespan, throughput (against the idle capacity) and preemptions (see the module docstring).

    The ``_steps`` figures divide times by the engine's mean step over them
    (its inter-token latency): what a CPU busy with other work does not change.
    """
    batch = [r for r in run.results if r.priority == scenario.batch_priority]
    direct = [r for r in baseline.results if r.priority == scenario.batch_priority]
    tp, span = throughput(batch), _span(batch)
    direct_tp, direct_span = throughput(direct), _span(direct)
    itl = None if span is None else itl_between(run.engine, *span)
    direct_itl = None if direct_span is None else itl_between(baseline.engine, *direct_span)
    figures: dict[str, float | None] = {
        "requests": len(batch),
        "ok": sum(r.ok for r in batch),
        "tokens": sum(r.tokens for r in batch if r.ok),
        "makespan_s": tp.makespan or None,
        "makespan_ratio": _maybe_ratio(tp.makespan, direct_tp.makespan),
        "itl_ms": _ms(itl),
        "makespan_steps_ratio": None if itl is None or direct_itl is None
        else _maybe_ratio(tp.makespan / itl, direct_tp.makespan / direct_itl),
        "tokens_per_s": tp.tokens_per_s,
        "alone_tokens_per_s": None if alone is None else alone.tokens_per_s,
        "others_slot_share": None,
        "idle_capacity_tokens_per_s": None,
        "capacity_ratio": None,
        "capacity_steps_ratio": None,
        "preemptions": sum(r.preempted for r in batch),
        "preemptions_per_request": _maybe_ratio(sum(r.preempted for r in batch), len(batch)),
        "processor_preemptions_per_request": _maybe_ratio(run.processor.get("preemptions"), len(batch)),
    }
    if alone is not None and span is not None:
        share = slot_share([r for r in run.results if r.priority != scenario.batch_priority and r.ok], span, run.slots)
        if share is not None:
            capacity = alone.tokens_per_s * max(0.0, 1.0 - share)
            per_step = None if itl is None or alone.itl_s is None else _maybe_ratio(
                tp.tokens_per_s * itl, capacity * alone.itl_s)
            figures.update(others_slot_share=share, idle_capacity_tokens_per_s=capacity,
                           capacity_ratio=_maybe_ratio(tp.tokens_per_s, capacity), capacity_steps_ratio=per_step)
    return figures


def class_figures(results: Sequence[Result], direct: Sequence[Result]) -> dict[str, dict[str, Any]]:
    """Each class's TTFT p50/p99 and tokens per second, and their ratios to the same class straight to the engine."""
    figures: dict[str, dict[str, Any]] = {}
    for cls in sorted({priority_label(r) for r in results}):
        mine = [r for r in results if priority_label(r) == cls]
        theirs = [r for r in direct if priority_label(r) == cls]
        block, base = latency(mine), latency(theirs)
        rate, base_rate = throughput(mine).tokens_per_s, throughput(theirs).tokens_per_s
        figures[cls] = {
            "ok": block["ok"], "requests": block["requests"], "ttft": block["ttft"],
            "ttft_ratio": slowdown(block, base), "tokens_per_s": rate, "tokens_ratio": _maybe_ratio(rate, base_rate),
        }
    return figures


def time_mean(samples: Sequence[EngineSample], start: float, end: float) -> float | None:
    """The running count averaged over time in [start, end] (each sample holds until the next)."""
    if not samples:
        return None
    total = covered = 0.0
    ends = [s.at for s in samples[1:]] + [end]
    for here, until in zip(samples, ends, strict=True):
        a, b = max(here.at, start), min(until, end)
        if b > a:
            total += here.running * (b - a)
            covered += b - a
    return total / covered if covered > 0 else None


def _overlap(a: float, b: float, intervals: Sequence[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in intervals)


def held_intervals(results: Iterable[Result]) -> list[tuple[float, float]]:
    """When the gateway held at least one of ``results``: from the answered attempt's send to its release."""
    return _merge((r.resent if r.resent is not None else r.sent, r.released_at)
                  for r in results if r.released_at is not None and r.queue_wait)


def empty_slots_while_held(
    samples: Sequence[EngineSample], held: Sequence[tuple[float, float]], slots: int
) -> dict[str, float]:
    """Time the engine had empty slots nothing waited for while the gateway held requests, and those slot-seconds.

    A slot is empty when the engine neither runs nor queues a request for it:
    ``slots - running - waiting``. The engine's page shows its last step's
    stats (vLLM's and the simulator's), so a request that finished in that
    step has left ``running`` while the one that takes its slot at the next
    step's start is still ``waiting``: that slot is not empty, and counting it
    would charge the gateway for every completion.
    """
    below = lost = 0.0
    for here, after in zip(samples, samples[1:], strict=False):
        empty = slots - here.running - here.waiting
        if empty > 0:
            overlap = _overlap(here.at, after.at, held)
            below += overlap
            lost += empty * overlap
    return {"below_s": below, "slot_s": lost}


def refill_gaps(releases: Sequence[float], completions: Sequence[float], slots: int) -> list[float]:
    """How long each completion's slot waited for the gateway's release that refilled it.

    With the engine's ``slots`` full, the k-th completion frees the slot the
    (k + slots)-th release fills: the gap is that release's time less the
    completion's. Negative: the gateway had released it before (into the
    engine's queue, or it saw the end before the client did).
    """
    releases, completions = sorted(releases), sorted(completions)
    return [releases[k + slots] - done for k, done in enumerate(completions) if k + slots < len(releases)]


def itl_between(samples: Sequence[EngineSample], start: float, end: float) -> float | None:
    """The engine's mean inter-token latency (one step of a running request) in [start, end], from its counters."""
    inside = [s for s in samples if start <= s.at <= end and s.itl_sum is not None and s.itl_count is not None]
    if len(inside) < 2:
        return None
    first, last = inside[0], inside[-1]
    assert first.itl_sum is not None and first.itl_count is not None
    assert last.itl_sum is not None and last.itl_count is not None
    count = last.itl_count - first.itl_count
    return (last.itl_sum - first.itl_sum) / count if count > 0 else None


def first_full(samples: Sequence[EngineSample], slots: int) -> float | None:
    """When the engine was first seen running all its slots (None: never)."""
    return next((s.at for s in samples if s.running >= slots), None)


def conservation(scenario: Scenario, run: ArmRun, baseline: ArmRun) -> dict[str, float | str | None]:
    """Does the gateway keep the engine as busy as straight to it, and where does a gap come from."""

    def busy(r: ArmRun) -> tuple[float | None, float, float | None]:
        span = _span([x for x in r.results if x.priority == scenario.batch_priority])
        if span is None:
            return None, 0.0, None
        return time_mean(r.engine, *span), span[1] - span[0], itl_between(r.engine, *span)

    running, makespan, itl = busy(run)
    direct_running, direct_makespan, direct_itl = busy(baseline)
    # Empty slot-seconds over the whole makespan, every arm alike (direct too: its intake and its end).
    empty_all = None if running is None else (run.slots - running) * makespan
    direct_empty = None if direct_running is None else (baseline.slots - direct_running) * direct_makespan
    steps = None if itl is None else makespan / itl
    direct_steps = None if direct_itl is None else direct_makespan / direct_itl
    batch = [r for r in run.results if r.priority == scenario.batch_priority]
    held = held_intervals(batch)
    empty = empty_slots_while_held(run.engine, held, run.slots)
    full = first_full(run.engine, run.slots)
    # The start: until the engine first ran all its slots (the gateway learning or filling them).
    ramp = empty_slots_while_held(run.engine, [(a, min(b, full)) for a, b in held if full is not None and a < full],
                                  run.slots)
    completions = sum(any(a <= r.done_at < b for a, b in held) for r in batch if r.ok)
    # The releases at the processor's clock (its decision log), else as the client saw them.
    logged = [d.at for d in run.decisions if d.outcome == "released" and d.band == scenario.batch_priority]
    releases = logged or [t for r in batch if (t := r.released_at) is not None]
    gaps = refill_gaps(releases, [r.done_at for r in batch if r.ok], run.slots) if releases else []
    return {
        "makespan_s": makespan or None,
        "makespan_ratio": _maybe_ratio(makespan, direct_makespan),
        "itl_ms": _ms(itl),
        "makespan_steps": steps,
        "makespan_steps_ratio": _maybe_ratio(steps, direct_steps),
        "running_mean": running,
        "running_ratio": _maybe_ratio(running, direct_running),
        "empty_slot_s": empty_all,
        "empty_slot_s_over_direct": None if empty_all is None or direct_empty is None else empty_all - direct_empty,
        "first_full_s": full,
        "ramp_empty_slot_s": ramp["slot_s"],
        "held_s": sum(b - a for a, b in held),
        "below_slots_while_held_s": empty["below_s"],
        "empty_slot_s_while_held": empty["slot_s"],
        "completions_while_held": completions,
        "empty_slot_ms_per_completion": 1e3 * empty["slot_s"] / completions if completions else None,
        "releases_from": "decision log" if logged else "client" if releases else None,
        "refills": len(gaps),
        "refill_ms_mean": 1e3 * statistics.fmean(gaps) if gaps else None,
        "refill_ms_p50": 1e3 * percentile(gaps, 50) if gaps else None,
        "refill_ms_p99": 1e3 * percentile(gaps, 99) if gaps else None,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _maybe_ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None:
        return None
    return _ratio(value, reference)


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
