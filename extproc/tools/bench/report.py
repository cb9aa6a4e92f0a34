"""Turn summaries into the benchmark's outputs: results.json, summary.md and PNG plots.

The Markdown tables are what docs/reports/benchmarks.md quotes; the targets table
reports each target of the project beside the measured value, without
judging the run a failure (a benchmark reports, tests assert).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from extproc.tools.bench.arms import DIRECT, TARGET_WAITING, Arm
from extproc.tools.bench.metrics import cumulative_service
from extproc.tools.bench.overhead import FAST_PATH
from extproc.tools.bench.runner import ArmRun
from extproc.tools.bench.scenarios import (
    BATCH,
    CLASSES,
    CONSERVATION,
    LOCALITY,
    OBJECTIVES,
    TRACE,
    Scenario,
)
from extproc.tools.bench.trace import describe
from extproc.tools.plots import pyplot

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 80
# More tenants than this (a replayed trace's 26): their service lines go without a legend.
LEGEND_TENANTS = 12
# The project's targets (reported, not asserted).
NEWCOMER_SPEEDUP = 20.0
THROUGHPUT_RATIO = 0.97
WAITING_SLACK = 2
JAIN_VTC = 0.99
FLOOD_SLOWDOWN = 1.5
# The hop's cost on the metadata fast path (the overhead benchmark): processor CPU per request at
# saturation (32 connections), the rate it then holds and releases against Envoy alone's in the same
# run, the latency it adds at the fixed rate over what the hop alone adds in the same run (a processor
# that only says CONTINUE: the floor, which moves with the machine's load), and the processor's memory
# per held request on the h2 transport. In the targets table, so that a feature that costs shows at once.
CPU_US_PER_REQUEST = 250
RATE_VS_ENVOY = 0.45
ADDED_OVER_FLOOR_P50_MS = 0.2
KB_PER_HELD = 5.0
# The targets of priority inside the engine.
WITHIN_OBJECTIVE = 0.99
IDLE_CAPACITY_SHARE = 0.9
# "No class worse than straight to the engine": read as TTFT p50 and p99 within this
# factor of direct FIFO's (the envoy control's spread) and tokens/s at THROUGHPUT_RATIO.
CLASS_TTFT_SLACK = 1.1
BATCH_MAKESPAN_SLACK = 1.05
RUNNING_RATIO = 0.97
# Scenarios whose batch answers arrive whole (non-streamed): their tokens by the horizon jump
# by a whole answer at a time, so the throughput target reads their own figures instead
# (batch makespan, throughput vs idle capacity, running requests).
WHOLE_ANSWERS = ("batch-flood", "batch-only")


def _get(data: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(data, Mapping) or data.get(key) is None:
            return None
        data = data[key]
    return data


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return f"{seconds:.2f}" if seconds < 10 else f"{seconds:.1f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _pct(block: Any, metric: str) -> str:
    """``p50 / p95 / p99`` of a latency block, model seconds."""
    return " / ".join(_s(_get(block, metric, q)) for q in ("p50", "p95", "p99"))


# --- targets ---------------------------------------------------------------------------


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def _worst(
    summaries: Mapping[str, Mapping[str, Any]], arm: str, path: tuple[str, ...], *, highest: bool
) -> tuple[str, float] | None:
    """The scenario where ``arm``'s value at ``path`` is worst (highest or lowest), and that value."""
    known = {name: v for name, s in summaries.items() if (v := _get(s, arm, *path)) is not None}
    if not known:
        return None
    return (max if highest else min)(known.items(), key=lambda kv: kv[1])


def targets(
    summaries: Mapping[str, Mapping[str, Any]], arms: Sequence[Arm], overhead: Mapping[str, Any] | None
) -> list[dict[str, Any]]:
    """Each target this run measured, with its value per gateway arm (None: that arm did not give it).

    A target is listed when the scenario (or the overhead benchmark) that
    measures it ran: ``--overhead-only`` lists the hop's targets alone.
    """
    rows: list[dict[str, Any]] = []
    gated = [a for a in arms if a.gateway == "extproc"]

    def add(target: str, arm: str, value: float | None, shown: str, met: bool | None) -> None:
        rows.append({"target": target, "arm": arm, "value": value, "shown": shown, "met": met})

    power = summaries.get("power-user")
    for arm in gated if power is not None else ():
        fifo = _get(power, DIRECT.name, "focus", "ttft", "p50")
        mine = _get(power, arm.name, "focus", "ttft", "p50")
        speedup = _ratio(fifo, mine)
        add(f"power-user newcomer TTFT p50 >= {NEWCOMER_SPEEDUP:g}x better than direct FIFO", arm.name, speedup,
            "–" if speedup is None else f"{speedup:.0f}x ({_s(mine)} s vs {_s(fifo)} s)",
            None if speedup is None else speedup >= NEWCOMER_SPEEDUP)
    streamed = {name: s for name, s in summaries.items() if name not in WHOLE_ANSWERS}
    for arm in gated if streamed else ():
        worst = _worst(streamed, arm.name, ("throughput", "horizon_tokens_ratio"), highest=False)
        add(f"throughput (output tokens in the common horizon) >= {THROUGHPUT_RATIO} of direct FIFO", arm.name,
            worst[1] if worst else None,
            "–" if worst is None else f"{worst[1]:.3f} (lowest, {worst[0]})",
            None if worst is None else worst[1] >= THROUGHPUT_RATIO)
    for arm in gated if summaries else ():
        worst = _worst(summaries, arm.name, ("engine", "waiting_max"), highest=True)
        limit = TARGET_WAITING + WAITING_SLACK
        add(f"engine waiting max <= target + {WAITING_SLACK} ({limit})", arm.name, worst[1] if worst else None,
            "–" if worst is None else f"{worst[1]:.0f} (highest, {worst[0]})",
            None if worst is None else worst[1] <= limit)
    for arm in gated if summaries else ():
        means = [_get(s, arm.name, "fairness", "mean") for s in summaries.values()]
        measured = [m for m in means if m is not None]
        vtc = arm.model.get("policy") == "vtc"
        lowest = min(measured) if measured else None
        add(f"Jain >= {JAIN_VTC} under vtc", arm.name, lowest,
            "–" if lowest is None else f"{lowest:.3f} (lowest scenario mean)" + ("" if vtc else "; not a vtc arm"),
            None if lowest is None or not vtc else lowest >= JAIN_VTC)
    for name in ("priority-mix", "batch-flood"):
        mix = summaries.get(name, {})
        for arm in (a for a in gated if a.name in mix):
            loaded = _get(mix, arm.name, "focus_loaded", "ttft", "p99")
            unloaded = _get(mix, arm.name, "focus_unloaded", "ttft", "p99")
            slowdown = _ratio(loaded, unloaded)
            add(f"interactive TTFT p99 under batch flood <= {FLOOD_SLOWDOWN}x unloaded ({name})", arm.name, slowdown,
                "–" if slowdown is None else f"{slowdown:.1f}x ({_s(loaded)} s vs {_s(unloaded)} s)",
                None if slowdown is None else slowdown <= FLOOD_SLOWDOWN)
    rows += _priority_targets(summaries, gated)
    rows += _overhead_targets(overhead or {})
    return rows


def _overhead_targets(overhead: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What the hop costs on the metadata fast path, each figure where the overhead benchmark gave it."""
    rows: list[dict[str, Any]] = []

    def add(target: str, arm: str, value: float, shown: str, met: bool) -> None:
        rows.append({"target": target, "arm": arm, "value": value, "shown": shown, "met": met})

    hop = _get(overhead, "paths", FAST_PATH)
    cpu = _get(hop, "cpu_us_per_request_max", "extproc")
    if cpu is not None:
        add(f"processor CPU per request at saturation <= {CPU_US_PER_REQUEST} µs", FAST_PATH, cpu,
            f"{cpu:,.0f} µs (at {_get(hop, 'max', 'rate'):,.0f} req/s; "
            f"{_get(hop, 'cpu_us_per_request_fixed', 'extproc'):,.0f} µs at {overhead['fixed_rate']} req/s)",
            cpu <= CPU_US_PER_REQUEST)
    share = _get(overhead, "extproc_rate_vs_envoy")
    if share is not None:
        add(f"held-and-released rate >= {RATE_VS_ENVOY} of Envoy alone's (max rate, same run)", FAST_PATH, share,
            f"{share:.2f} ({_get(hop, 'max', 'rate'):,.0f} vs {_get(overhead, 'paths', 'envoy', 'max', 'rate'):,.0f} "
            "req/s)", share >= RATE_VS_ENVOY)
    added = _get(overhead, "extproc_added_ms", "p50")
    floor = _get(overhead, "floor", "added_ms", "p50")
    if added is not None and floor is not None:
        over = added - floor
        add(f"ext_proc added p50 <= the hop's floor + {ADDED_OVER_FLOOR_P50_MS:g} ms at {overhead['fixed_rate']} "
            "req/s (same run)", FAST_PATH, over, f"{added:.2f} ms (floor {floor:.2f} ms: +{over:.2f})",
            over <= ADDED_OVER_FLOOR_P50_MS + 1e-9)
    held = _get(overhead, "transports", "builtin")
    kb = _get(held, "kb_per_held")
    if kb is not None:
        add(f"processor memory per held request <= {KB_PER_HELD:g} KB", "builtin", kb,
            f"{kb:.1f} KB ({_num(_get(held, 'held'), 0)} held)", kb <= KB_PER_HELD)
    return rows


def _priority_targets(summaries: Mapping[str, Mapping[str, Any]], gated: Sequence[Arm]) -> list[dict[str, Any]]:
    """Objective attainment, batch throughput, no class worse than direct, work conservation (priority inside the engine)."""
    rows: list[dict[str, Any]] = []

    def add(target: str, arm: str, value: float | None, shown: str, met: bool | None) -> None:
        rows.append({"target": target, "arm": arm, "value": value, "shown": shown, "met": met})

    for name in ("priority-mix", "batch-flood", "steady-classes"):
        mix = summaries.get(name, {})
        for arm in (a for a in gated if a.name in mix):
            got = _get(mix, arm.name, "focus_objective")
            share = _get(got, "share")
            add(f">= {WITHIN_OBJECTIVE:.0%} of interactive requests within their TTFT objective ({name})", arm.name,
                share, "–" if share is None else f"{share:.1%} ({got['met']}/{got['requests']} within "
                f"{_s(got['objective_s'])} s)", None if share is None else share >= WITHIN_OBJECTIVE)
    def stepped(target: str, arm: str, block: Any, key: str, detail: str, met: Callable[[float], bool]) -> None:
        """A wall-clock ratio, shown with its detail and the same ratio per engine step (a busy CPU leaves it)."""
        ratio, steps = _get(block, key), _get(block, key.replace("_ratio", "_steps_ratio"))
        add(target, arm, ratio, "–" if ratio is None else f"{ratio:.3f} ({detail}; per engine step {_num(steps, 3)})",
            None if ratio is None else met(ratio))

    flood = summaries.get("batch-flood", {})
    for arm in (a for a in gated if a.name in flood):
        b = _get(flood, arm.name, "batch")
        stepped(f"batch throughput >= {IDLE_CAPACITY_SHARE} of the idle capacity (batch-flood)", arm.name, b,
                "capacity_ratio", f"{_num(_get(b, 'tokens_per_s'), 0)} vs "
                f"{_num(_get(b, 'idle_capacity_tokens_per_s'), 0)} tokens/s", lambda r: r >= IDLE_CAPACITY_SHARE)
    steady = summaries.get("steady-classes", {})
    for arm in (a for a in gated if a.name in steady):
        classes = _get(steady, arm.name, "classes") or {}
        ttft = [(v, f"{cls} {q}") for cls, c in classes.items() for q in ("p50", "p99")
                if (v := _get(c, "ttft_ratio", q)) is not None]
        tokens = [(v, cls) for cls, c in classes.items() if (v := c.get("tokens_ratio")) is not None]
        if not ttft or not tokens:
            add("no class worse than direct FIFO (steady-classes)", arm.name, None, "–", None)
            continue
        worst, what = max(ttft)
        least, which = min(tokens)
        add(f"no class worse than direct FIFO: TTFT p50/p99 <= {CLASS_TTFT_SLACK}x, tokens/s >= {THROUGHPUT_RATIO} "
            "(steady-classes)", arm.name, worst,
            f"worst TTFT {worst:.2f}x ({what}), tokens {least:.3f} ({which})",
            worst <= CLASS_TTFT_SLACK and least >= THROUGHPUT_RATIO)
    only = summaries.get("batch-only", {})
    for arm in (a for a in gated if a.name in only):
        c = _get(only, arm.name, "conservation")
        stepped(f"batch-only makespan within {BATCH_MAKESPAN_SLACK - 1:.0%} of direct FIFO", arm.name, c,
                "makespan_ratio", f"{_s(_get(c, 'makespan_s'))} s vs "
                f"{_s(_get(only, DIRECT.name, 'conservation', 'makespan_s'))} s", lambda r: r <= BATCH_MAKESPAN_SLACK)
        running = _get(only, arm.name, "conservation", "running_ratio")
        add(f"batch-only mean running requests >= {RUNNING_RATIO} of direct FIFO", arm.name, running,
            "–" if running is None else f"{running:.3f} ({_num(_get(only, arm.name, 'conservation', 'running_mean'))} "
            f"vs {_num(_get(only, DIRECT.name, 'conservation', 'running_mean'))})",
            None if running is None else running >= RUNNING_RATIO)
    return rows


# --- Markdown ---------------------------------------------------------------------------


def scenario_markdown(
    scenario: Scenario, arms: Sequence[Arm], summary: Mapping[str, Any], engine: Mapping[str, Any] | None = None
) -> list[str]:
    """One scenario's tables; ``engine``: its own simulated GPU and time scale, where not the run's."""
    lines = [f"### {scenario.name}", "", scenario.description + ".", ""]
    if engine and "size" in engine:  # a real vLLM of its own (vllm.VllmEngine)
        kv = engine["kv_cache_tokens"]
        lines += [f"On its own real vLLM: the {engine['size']} model, {engine['max_num_seqs']} sequences, "
                  f"{'the default' if kv is None else kv} tokens of KV.", ""]
    elif engine:
        lines += [f"On its own simulated GPU: {engine['max_num_seqs']} sequences, {engine['step_ms']:g} ms steps "
                  f"+ {engine['step_ms_per_seq']:g} ms per running sequence, {engine['prefill_ms_per_token']:g} ms "
                  f"of prefill per prompt token, {engine['kv_cache_tokens']} tokens of KV; time scale "
                  f"{engine['time_scale']:g}.", ""]
    rows = []
    for arm in arms:
        s = summary.get(arm.name)
        if s is None:
            continue
        rows.append([
            arm.name,
            f"{s['ok']}/{s['requests']}",
            _pct(s["focus"], "ttft"),
            _s(_get(s, "focus", "e2e", "p99")),
            _s(_get(s, "all", "ttft", "p99")),
            _num(_get(s, "throughput", "horizon_tokens_ratio"), 3),
            _num(_get(s, "throughput", "requests_ratio"), 3),
            _num(_get(s, "throughput", "tokens_ratio"), 3),
            f"{_num(_get(s, 'engine', 'waiting_median'), 0)} / {_num(_get(s, 'engine', 'waiting_max'), 0)}",
            _jain(s),
            " / ".join(_s(_get(s, "focus", "queue_wait", q)) for q in ("p50", "p99")),
            _idle(s.get("idle_while_held")),
        ])
    over = "window" if scenario.window is not None else "run"
    lines += _table(
        ["arm", "ok", f"{scenario.focus} TTFT p50 / p95 / p99 (s)", f"{scenario.focus} e2e p99 (s)",
         "all TTFT p99 (s)", "tokens by horizon vs FIFO", "req/s vs FIFO", "tokens/s vs FIFO",
         "engine waiting median / max",
         "Jain mean / min (windows)", f"{scenario.focus} gateway wait p50 / p99 (s)",
         f"idle slot-s while held (% of the {over})"],
        rows,
    )
    steps = [f"{arm.name} {_num(step, 1)} ms" for arm in arms
             if (step := _get(summary, arm.name, "engine", "itl_ms")) is not None]
    if steps:
        lines += ["", "The engine's mean step (inter-token latency) over the run, which a CPU busy with other work "
                  "lengthens: " + ", ".join(steps) + "."]
    if any("focus_unloaded" in s for s in summary.values()) and TRACE not in scenario.measures:
        lines += _unloaded_table(scenario, arms, summary)  # a trace's reference is in its own table
    if OBJECTIVES in scenario.measures:
        lines += _objectives_table(arms, summary)
    if BATCH in scenario.measures:
        lines += _batch_table(arms, summary)
    if CLASSES in scenario.measures:
        lines += _classes_table(arms, summary)
    if CONSERVATION in scenario.measures:
        lines += _conservation_table(arms, summary)
    if LOCALITY in scenario.measures:
        lines += _locality_table(scenario, arms, summary)
    if TRACE in scenario.measures:
        lines += _trace_tables(scenario, arms, summary)
    lines += _processor_table(arms, summary)
    for kind, title in (("tenants", "tenant"), ("priorities", "priority class")):
        groups = sorted({g for s in summary.values() for g in s[kind]})
        if kind == "priorities" and groups == ["default"]:
            continue
        lines += ["", f"TTFT and e2e p50 / p95 / p99 (s) per {title}:", ""]
        lines += _table(
            [title, *(f"{arm.name} TTFT" for arm in arms if arm.name in summary),
             *(f"{arm.name} e2e" for arm in arms if arm.name in summary)],
            [
                [g, *(_pct(summary[a.name][kind].get(g), "ttft") for a in arms if a.name in summary),
                 *(_pct(summary[a.name][kind].get(g), "e2e") for a in arms if a.name in summary)]
                for g in groups
            ],
        )
    lines += ["", f"![{scenario.name}: {scenario.focus} TTFT by arm]({scenario.name}-ttft.png)",
              f"![{scenario.name}: engine waiting queue over time]({scenario.name}-waiting.png)",
              f"![{scenario.name}: cumulative service per tenant]({scenario.name}-service.png)", ""]
    return lines


def _unloaded_table(scenario: Scenario, arms: Sequence[Arm], summary: Mapping[str, Any]) -> list[str]:
    where = ("replayed alone on the same stack first" if scenario.phases
             else "its requests sent before the flood")
    rows = []
    for arm in arms:
        s = summary.get(arm.name)
        if s is None or "focus_unloaded" not in s:
            continue
        ratio = s.get("slowdown") or {
            "p99": _ratio(_get(s, "focus_loaded", "ttft", "p99"), _get(s, "focus_unloaded", "ttft", "p99"))}
        rows.append([arm.name, _pct(s["focus_unloaded"], "ttft"), _pct(s["focus_loaded"], "ttft"),
                     _num(ratio.get("p50"), 1), _num(ratio.get("p99"), 1)])
    return ["", f"{scenario.focus} TTFT unloaded ({where}) and during the flood:", "",
            *_table(["arm", "unloaded p50 / p95 / p99 (s)", "during flood p50 / p95 / p99 (s)", "p50 slowdown",
                     "p99 slowdown"], rows)]


def _objectives_table(arms: Sequence[Arm], summary: Mapping[str, Any]) -> list[str]:
    classes = sorted({c for s in summary.values() for c in s.get("objectives", {})})
    if not classes:
        return []

    def cell(got: Any) -> str:
        if got is None or got.get("share") is None:
            return "–"
        return f"{got['share']:.1%} ({got['met']}/{got['requests']})"

    rows = [[arm.name, *(cell(_get(summary, arm.name, "objectives", c)) for c in classes)]
            for arm in arms if arm.name in summary]
    objective = {c: next((_get(s, "objectives", c, "objective_s") for s in summary.values()
                          if _get(s, "objectives", c, "objective_s") is not None), None) for c in classes}
    return ["", "Requests whose TTFT met their class's objective (all of the run; the processor's "
            "ttft_objective_s, model seconds):", "",
            *_table(["arm", *(f"{c} within {_s(objective[c])} s" for c in classes)], rows)]


def _arm_rows(
    arms: Sequence[Arm], summary: Mapping[str, Any], key: str, row: Callable[[Mapping[str, Any]], list[str]]
) -> list[list[str]]:
    """One row per arm whose summary has ``key``: its name, then ``row`` of that block."""
    return [[arm.name, *row(block)] for arm in arms if (block := _get(summary, arm.name, key)) is not None]


def _batch_table(arms: Sequence[Arm], summary: Mapping[str, Any]) -> list[str]:
    def row(b: Mapping[str, Any]) -> list[str]:
        return [
            f"{b['ok']}/{b['requests']}", _s(b["makespan_s"]), _num(b["makespan_ratio"], 2),
            _num(b["itl_ms"], 1), _num(b["makespan_steps_ratio"], 2),
            _num(b["tokens_per_s"], 0), _num(b["alone_tokens_per_s"], 0),
            "–" if b["others_slot_share"] is None else f"{b['others_slot_share']:.0%}",
            _num(b["idle_capacity_tokens_per_s"], 0), _num(b["capacity_ratio"], 2),
            _num(b["capacity_steps_ratio"], 2),
            f"{_num(b['preemptions_per_request'], 2)} / {_num(b['processor_preemptions_per_request'], 2)}",
        ]

    return ["", "The batch class (makespan: its first send to its last answer; idle capacity: the batch alone "
            "straight to the engine, times the share of slots the others leave free; per step: each time over the "
            "engine's mean inter-token latency then, which a busy CPU does not change):", "",
            *_table(["arm", "batch ok", "batch makespan (s)", "vs direct", "step (ms)", "in steps vs direct",
                     "batch tokens/s", "alone tokens/s", "slots the others took", "idle capacity tokens/s",
                     "vs idle capacity", "per step vs idle capacity",
                     "preemptions per batch request (client / processor)"], _arm_rows(arms, summary, "batch", row))]


def _classes_table(arms: Sequence[Arm], summary: Mapping[str, Any]) -> list[str]:
    ran = [a for a in arms if a.name in summary]
    classes = sorted({c for s in summary.values() for c in s.get("classes", {})})
    rows = []
    for cls in classes:
        for arm in ran:
            c = _get(summary, arm.name, "classes", cls)
            if c is None:
                continue
            rows.append([cls, arm.name, f"{c['ok']}/{c['requests']}",
                         " / ".join(_s(_get(c, "ttft", q)) for q in ("p50", "p99")),
                         " / ".join(_num(_get(c, "ttft_ratio", q)) for q in ("p50", "p99")),
                         _num(c["tokens_per_s"], 0), _num(c["tokens_ratio"], 3)])
    return ["", "Each class against straight to the engine:", "",
            *_table(["class", "arm", "ok", "TTFT p50 / p99 (s)", "vs direct p50 / p99", "tokens/s",
                     "tokens/s vs direct"], rows)]


def _conservation_table(arms: Sequence[Arm], summary: Mapping[str, Any]) -> list[str]:
    def row(c: Mapping[str, Any]) -> list[str]:
        return [
            _s(c["makespan_s"]), _num(c["makespan_ratio"], 3), _num(c["itl_ms"], 1),
            _num(c["makespan_steps_ratio"], 3), _num(c["running_mean"]), _num(c["running_ratio"], 3),
            _s(c["empty_slot_s"]), _s(c["empty_slot_s_over_direct"]), _s(c["first_full_s"]), _s(c["held_s"]),
            _s(c["below_slots_while_held_s"]),
            _s(c["empty_slot_s_while_held"]), _s(c["ramp_empty_slot_s"]), str(c["completions_while_held"]),
            _num(c["empty_slot_ms_per_completion"], 0),
            f"{_num(c['refill_ms_mean'], 0)} / {_num(c['refill_ms_p50'], 0)} / {_num(c['refill_ms_p99'], 0)}",
        ]

    return ["", "Work conservation (the batch's makespan, also in engine steps: over its mean inter-token latency; "
            "running: vllm:num_requests_running averaged over it; held: some batch request sent and not yet released "
            "by the gateway; refill: from a completion to the release that refilled its slot, at the processor's "
            "clock):", "",
            *_table(["arm", "makespan (s)", "vs direct", "step (ms)", "in steps vs direct", "mean running",
                     "vs direct", "empty slot-s", "more than direct", "first at all slots (s)", "held (s)",
                     "below all slots while held (s)",
                     "empty slot-s while held", "of them before all slots ran", "completions while held",
                     "empty slot-ms per completion", "refill mean / p50 / p99 (ms)"],
                    _arm_rows(arms, summary, "conservation", row))]


def _locality_table(scenario: Scenario, arms: Sequence[Arm], summary: Mapping[str, Any]) -> list[str]:
    rows = [[arm.name, _num(_get(s, "locality", "hit_rate"), 3),
             f"{_num(_get(s, 'locality', 'hit_tokens'), 0)} / {_num(_get(s, 'locality', 'queried_tokens'), 0)}",
             _num(_get(s, "throughput", "requests_ratio"), 3), _num(_get(s, "throughput", "tokens_ratio"), 3),
             _s(_get(s, "throughput", "makespan_s")),
             " / ".join(_num(share, 2) for share in _get(s, "locality", "replica_shares") or [None]),
             f"{_num(_get(s, 'locality', 'service_difference', 'mean'), 1)} / "
             f"{_num(_get(s, 'locality', 'service_difference', 'max'), 1)}"]
            for arm in arms if (s := summary.get(arm.name)) is not None]
    return ["", "Prefix cache and fairness: the engines' prefix-cache hit rate (hit / queried prompt tokens, every "
            f"replica), throughput against the FIFO baseline ({scenario.baseline}), and the VTC paper's service "
            "difference as its artifact computes it (per 10 s window at 19 ticks, the largest shortfall of a tenant's "
            "service rate from the best-served tenant's, capped by what it asked for; service units/s, mean / max; "
            "lower is fairer):", "",
            *_table(["arm", "hit rate", "hit / queried tokens", "req/s vs FIFO", "tokens/s vs FIFO", "makespan (s)",
                     "queried tokens per replica (share)", "service difference mean / max"], rows),
            "", f"![{scenario.name}: prefix-cache hit rate, throughput, service difference]"
            f"({scenario.name}-locality.png)"]


def _processor_table(arms: Sequence[Arm], summary: Mapping[str, Any]) -> list[str]:
    """The processors' own figures: one instance and a cluster side by side (cost of Redis on the hot path)."""
    rows = [
        [arm.name, str(arm.instances), _num(p["releases_per_s"], 1), _num(p["cpu_ms_per_request"]),
         _num(p["round_trips_per_release"]), _num(p["round_trip_mean_ms"]),
         f"{_num(p['round_trip_p50_ms'])} / {_num(p['round_trip_p99_ms'])}"]
        for arm in arms if (p := _get(summary, arm.name, "processor")) is not None
    ]
    if not rows:
        return []
    return ["", "Processors (wall clock; summed over instances; round-trip percentiles are histogram bucket bounds):",
            "", *_table(["arm", "instances", "releases/s", "processor CPU ms/request", "Redis round trips/release",
                         "round trip mean (ms)", "round trip p50 / p99 (ms)"], rows)]


def _idle(block: Mapping[str, Any] | None) -> str:
    """The engine's idle slot-seconds while the gateway held requests, and their share of its slot-seconds."""
    if block is None:
        return "–"
    share = block.get("share")
    return f"{_s(block['slot_s'])} ({'–' if share is None else f'{share:.1%}'})"


def _window_ttft(block: Mapping[str, Any], window: float) -> str:
    """TTFT p50 / p99 in a window; a percentile past it (among requests without a first token) as ``> window``."""
    return " / ".join(f"> {window:.0f}" if q in block["beyond"] else _s(block[q]) for q in ("p50", "p99"))


def _trace_tables(scenario: Scenario, arms: Sequence[Arm], summary: Mapping[str, Any]) -> list[str]:
    """A replayed trace: what was replayed, each class in the window, each arm's idle slots and reference."""
    ran = [a for a in arms if a.name in summary]
    window = next((w for a in ran if (w := _get(summary, a.name, "trace", "window_s")) is not None), 0.0)
    classes = sorted({c for a in ran for c in _get(summary, a.name, "trace", "classes") or {}})
    rows = []
    for cls in classes:
        for arm in ran:
            c = _get(summary, arm.name, "trace", "classes", cls)
            if c is None:
                continue
            rows.append([
                cls, arm.name, str(c["requests"]), str(c["answered"]),
                f"{c['not_answered']} ({c['cut_waiting']} / {c['cut_streaming']} / {c['failed']})",
                _window_ttft(c["ttft"], window),
                "–" if c["missed"] is None else f"{c['missed']} / {_num(c['processor_missed'], 0)}",
                _num(c["tokens"], 0), _num(c["tokens_vs_direct"], 3),
            ])
    arm_rows = []
    for arm in ran:
        t, idle = _get(summary, arm.name, "trace"), _get(summary, arm.name, "idle_while_held")
        ref = t["focus_reference"]
        arm_rows.append([
            arm.name, "–" if idle is None else _s(idle["slot_s"]),
            "–" if idle is None or idle["share"] is None else f"{idle['share']:.1%}",
            "–" if idle is None else _s(idle["held_s"]),
            f"{_num(ref['p99_vs_quiet'], 1)} ({'> ' + format(window, '.0f') if ref['p99'] is None else _s(ref['p99'])}"
            f" vs {_s(ref['quiet_p99'])} s)",
            _num(t["tokens_vs_direct"], 3),
        ])
    lines = ["", describe(scenario.replay), "",
             f"Each class in the window of {window:.0f} s (not answered: no first token / cut while streaming / "
             "failed; TTFT over every request of the class, one without a first token counted as later than any, "
             f"so `> {window:.0f}` is a percentile past the window; missed: no first token within the class's "
             "objective, counted by the client / by the processor's extproc_objective_requests_total; output "
             "tokens received by the end of the window):", "",
             *_table(["class", "arm", "requests", "answered in the window", "not answered", "TTFT p50 / p99 (s)",
                      "missed objective (client / processor)", "output tokens by the window's end", "vs direct"],
                     rows),
             "", f"Per arm (idle slot-s while held: the engine's empty slots (slots less running less waiting) "
             "integrated over the time the gateway held "
             f"at least one request of any class, and their share of its slot-seconds over the window; "
             f"{scenario.focus} p99 against the same chats alone straight to a quiet engine):", "",
             *_table(["arm", "idle slot-s while held", "% of the window", "held (s)",
                      f"{scenario.focus} TTFT p99 vs quiet engine", "output tokens vs direct"], arm_rows)]
    lines += _against_priority_queue(ran, summary, classes)
    offered = next((o for a in ran if (o := _get(summary, a.name, "trace", "offered")) is not None), None)
    if offered is not None:
        lines += ["", "Offered load, computed from the engine model and measured straight to the engine (mean "
                  f"running / slots over the replayed span): the trace alone {_num(offered['expected'])} computed, "
                  f"{_num(offered['measured'])} measured; the chats alone {_num(offered['chats_expected'])} computed, "
                  f"{_num(offered['chats_measured'])} measured."]
    return lines


# The reference a gateway is held against on a trace: the engine's own priority queue, straight.
PRIORITY_REFERENCE = "direct-priority"


def _against_priority_queue(ran: Sequence[Arm], summary: Mapping[str, Any], classes: Sequence[str]) -> list[str]:
    """Each arm against straight to the engine's priority queue: per class its TTFT p99, worst-served tenant and
    requests answered in the window; the output tokens against straight FIFO, the idle slots while it held any."""
    reference = _get(summary, PRIORITY_REFERENCE, "trace")
    if reference is None:
        return []
    fifo_running = _get(summary, "direct-fifo", "engine", "running_mean")
    rows = []
    for arm in ran:
        t, idle = _get(summary, arm.name, "trace"), _get(summary, arm.name, "idle_while_held")
        cells = []
        for cls in classes:
            mine, ref = _get(t, "classes", cls), _get(reference, "classes", cls)
            worst, ref_worst = _get(mine, "worst_tenant"), _get(ref, "worst_tenant")
            against = _ratio(_get(worst, "p99"), _get(ref_worst, "p99"))
            cells += [
                _num(_ratio(_get(mine, "ttft", "p99"), _get(ref, "ttft", "p99")), 2),
                "–" if worst is None else f"{worst['tenant']} {_s(worst['p99'])} ({_num(against, 2)})",
                _num(_ratio(_get(mine, "answered"), _get(ref, "answered")), 2),
            ]
        rows.append([arm.name, *cells, _num(t["tokens_vs_direct"], 3),
                     _num(_ratio(_get(summary, arm.name, "engine", "running_mean"), fifo_running), 3),
                     "–" if idle is None or idle["share"] is None else f"{idle['share']:.2%}"])
    header = ["arm"]
    for cls in classes:
        header += [f"{cls} TTFT p99", f"{cls} worst tenant p99 (s)", f"{cls} answered"]
    return ["", f"Against straight to the engine's priority queue ({PRIORITY_REFERENCE}; ratios, lower is better for a "
            "TTFT, higher for requests answered; a worst tenant's ratio is against the reference's worst tenant), "
            "with output tokens in the window and the engine's slots in use (its mean running) against straight "
            "FIFO, and idle slot-seconds while anything was held (the tokens also follow what was served: a "
            "prompt's prefill stalls every running sequence, so an order that serves more of the long-prompt "
            "classes in the window gets fewer tokens from a busy engine):",
            "", *_table([*header, "output tokens vs FIFO", "slots in use vs FIFO", "idle while held"], rows)]


def _jain(summary: Mapping[str, Any]) -> str:
    f = summary["fairness"]
    if not f["windows"]:
        return "–"
    return f"{f['mean']:.3f} / {f['min']:.3f} ({f['windows']})"


def overhead_markdown(overhead: Mapping[str, Any]) -> list[str]:
    rows = []
    for path, p in overhead["paths"].items():
        cpu_fixed = p["cpu_us_per_request_fixed"]
        cpu_max = p["cpu_us_per_request_max"]
        rows.append([
            path,
            f"{p['fixed']['rate']:.0f}",
            f"{_num(p['fixed']['p50'])} / {_num(p['fixed']['p99'])}",
            f"{p['max']['rate']:,.0f}",
            f"{_num(p['max']['p50'])} / {_num(p['max']['p99'])}",
            ", ".join(f"{k} {v:,.0f}" for k, v in cpu_fixed.items()) or "–",
            ", ".join(f"{k} {v:,.0f}" for k, v in cpu_max.items()) or "–",
        ])
    lines = _table(
        ["path", "fixed rate (req/s)", "latency p50 / p99 (ms)", f"max rate ({overhead['max_workers']} conns, req/s)",
         "latency p50 / p99 (ms)", "CPU µs/request (fixed)", "CPU µs/request (max)"],
        rows,
    )
    added = overhead.get("extproc_added_ms")
    if added:
        by_round = ", ".join(_num(x, 1) for x in overhead["extproc_added_p50_ms_by_round"])
        envoy = _get(overhead, "paths", "envoy", "max", "rate")
        lines += ["", f"ext_proc adds **{_num(added['p50'])} ms at p50** and **{_num(added['p99'])} ms at p99** at "
                      f"{overhead['fixed_rate']} req/s (p50 added per round: {by_round} ms); it held and released up "
                      f"to **{overhead['extproc_max_rate']:,.0f} req/s** on this machine "
                      f"({_num(overhead['extproc_rate_vs_envoy'])} of Envoy alone's {envoy:,.0f}), using "
                      f"**{overhead['extproc_cpu_us_per_request_max']:,.0f} µs** of processor CPU per request there "
                      f"and {overhead['extproc_cpu_us_per_request']:,.0f} µs at {overhead['fixed_rate']} req/s."]
    floor = overhead.get("floor")
    if floor and added:
        by_round = ", ".join(_num(x, 1) for x in floor["added_p50_ms_by_round"])
        lines += ["", f"How much of the hop is the hop itself (at {overhead['fixed_rate']} req/s, added to Envoy alone; "
                      f"processor CPU per request; the floor's p50 added per round: {by_round} ms):", ""]
        lines += _table(
            ["path", "added p50 / p99 (ms)", "CPU µs/request (fixed)", "CPU µs/request (max)", "max rate (req/s)"],
            [["the hop's floor (a processor that only says CONTINUE)",
              f"{_num(floor['added_ms']['p50'])} / {_num(floor['added_ms']['p99'])}",
              _num(floor["cpu_us_per_request"], 0), _num(floor["cpu_us_per_request_max"], 0),
              _num(floor["max_rate"], 0)],
             [f"our processor ({FAST_PATH})", f"{_num(added['p50'])} / {_num(added['p99'])}",
              _num(overhead["extproc_cpu_us_per_request"], 0), _num(overhead["extproc_cpu_us_per_request_max"], 0),
              _num(overhead["extproc_max_rate"], 0)]],
        )
    by_attachment = overhead.get("added_ms") or {}
    if by_attachment:
        lines += ["", "Added to Envoy alone at the fixed rate, p50 / p99 (ms): " + "; ".join(
            f"{path} {_num(added['p50'])} / {_num(added['p99'])}" for path, added in by_attachment.items()) + "."]
    transports = overhead.get("transports") or {}
    if transports:
        lines += ["", "Per transport (`listen.transport`): memory per held request (processor RSS growth with the "
                      "streams held, Envoy not included) and processor CPU per request on the metadata fast path:", ""]
        lines += _table(
            ["transport", "held", "KB per held", "CPU µs per stream opened", "CPU µs/request (fixed)",
             "CPU µs/request (max)", "max rate (req/s)", "added p50 (ms)"],
            [[t, _num(f.get("held"), 0), _num(f.get("kb_per_held"), 1), _num(f.get("cpu_us_per_stream"), 0),
              _num(f.get("cpu_us_per_request_fixed"), 0), _num(f.get("cpu_us_per_request_max"), 0),
              _num(f.get("max_rate"), 0), _num(f.get("added_p50_ms"))] for t, f in transports.items()],
        )
    return lines


def markdown(
    meta: Mapping[str, Any],
    scenarios: Sequence[Scenario],
    arms: Sequence[Arm],
    summaries: Mapping[str, Mapping[str, Any]],
    overhead: Mapping[str, Any] | None,
) -> str:
    engine, machine = meta["engine"], meta["machine"]
    on = ("" if not summaries else
          f"engine: a real {engine['version']} server per arm, batch {engine['max_num_seqs']}, in real time; "
          if engine.get("kind") == "vllm" else
          f"engine: the simulator at time scale {meta['time_scale']} (latencies below are model seconds: wall clock / "
          "time scale); ")
    after = f", after {machine['loadavg_after']}" if "loadavg_after" in machine else ""
    lines = [
        "# Benchmark results",
        "",
        f"Run {meta['started']} on {machine['cpu']} ({machine['cores']} cores), load average before the run "
        f"{machine['loadavg_before']}{after}; {on}{meta['wall_s']:.0f} s in all.",
        "",
    ]
    if arms:
        lines += ["Arms: " + "; ".join(f"`{a.name}`: {a.description}" for a in arms) + ".", ""]
    marks = {True: "yes", False: "**no**", None: "–"}
    rows = [[r["target"], r["arm"], r["shown"], marks[r["met"]]] for r in targets(summaries, arms, overhead)]
    if rows:
        lines += ["## Targets", "", *_table(["target", "arm", "measured", "met"], rows), ""]
    if summaries:
        lines += ["## Scenarios", ""]
        for scenario in scenarios:
            lines += scenario_markdown(scenario, arms, summaries[scenario.name],
                                       meta.get("scenario_engines", {}).get(scenario.name))
    if overhead is not None:
        lines += ["## Overhead of the ext_proc hop (real time, fast upstream)", ""]
        lines += overhead_markdown(overhead)
        lines += [""]
    return "\n".join(lines)


# --- plots ------------------------------------------------------------------------------


@functools.cache
def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)


def plot_ttft(scenario: Scenario, arms: Sequence[Arm], summary: Mapping[str, Any], path: Path) -> None:
    """Grouped bars: the focus group's TTFT p50/p95/p99 per arm (log scale)."""
    names = [a.name for a in arms if a.name in summary]
    referenced = bool(names) and all("focus_unloaded" in summary[n] for n in names)
    block = "focus_loaded" if referenced else "focus"
    fig, ax = pyplot().subplots(figsize=(6.4, 3.2))
    width = 0.26
    for i, q in enumerate(("p50", "p95", "p99")):
        values = [_get(summary[n], block, "ttft", q) or math.nan for n in names]
        ax.bar([x + (i - 1) * width for x in range(len(names))], values, width, label=q)
    if referenced:
        unloaded = [_get(summary[n], "focus_unloaded", "ttft", "p99") or math.nan for n in names]
        ax.scatter(range(len(names)), unloaded, marker="_", s=600, color="black", zorder=3, label="p99 unloaded")
    quiet = _get(summary.get(names[0]) if names else None, "trace", "focus_reference", "quiet_p99")
    if quiet is not None:
        ax.axhline(quiet, color="black", linestyle="--", linewidth=0.8, label="p99 alone on a quiet engine")
    ax.set_xticks(range(len(names)), names)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (model s)")
    during = " during the flood" if referenced else " (answered in the window)" if scenario.window else ""
    ax.set_title(f"{scenario.name}: {scenario.focus} time to first token{during}", fontsize=10)
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_waiting(scenario: Scenario, runs: Sequence[ArmRun], path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(6.4, 3.0))
    for run in runs:
        ax.step([s.at for s in run.engine], [s.waiting for s in run.engine], where="post", label=run.arm, linewidth=1)
    ax.axhline(TARGET_WAITING, color="grey", linestyle="--", linewidth=0.8, label=f"target_waiting {TARGET_WAITING}")
    ax.set_yscale("symlog", linthresh=10)
    peak = max((s.waiting for run in runs for s in run.engine), default=0)
    ticks = [t for t in (0, TARGET_WAITING, 10, 30, 100, 300, 1000) if t <= max(peak, 10)]
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("time (model s)")
    ax.set_ylabel("engine waiting requests")
    ax.set_title(f"{scenario.name}: vllm:num_requests_waiting", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    _save(fig, path)


def plot_service(scenario: Scenario, runs: Sequence[ArmRun], path: Path) -> None:
    """Cumulative weighted service per tenant over time, one panel per arm."""
    end = max((r.done_at for run in runs for r in run.results), default=1.0)
    times = [end * i / 200 for i in range(201)]
    fig, axes = pyplot().subplots(1, len(runs), figsize=(3.0 * len(runs) + 0.6, 3.0), sharey=True, squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        for tenant in scenario.tenants:
            ax.plot(times, cumulative_service(run.results, tenant, times, scenario.weight(tenant)), label=tenant,
                    linewidth=1)
        ax.set_title(run.arm, fontsize=9)
        ax.set_xlabel("time (model s)")
    axes[0][0].set_ylabel("weighted service (token units)")
    if len(scenario.tenants) <= LEGEND_TENANTS:
        axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{scenario.name}: cumulative service per tenant", fontsize=10)
    _save(fig, path)


def plot_locality(scenario: Scenario, arms: Sequence[Arm], summary: Mapping[str, Any], path: Path) -> None:
    """Three panels per arm: the engines' prefix-cache hit rate, throughput vs the baseline, service difference."""
    names = [a.name for a in arms if a.name in summary]
    x = range(len(names))
    fig, (hits, rates, gaps) = pyplot().subplots(1, 3, figsize=(12.0, 3.4))
    hits.bar(x, [_get(summary[n], "locality", "hit_rate") or math.nan for n in names])
    hits.set_ylim(0, 1)
    hits.set_title("prefix-cache hit rate (tokens)", fontsize=9)
    width = 0.38
    for i, (key, label) in enumerate((("requests_ratio", "req/s"), ("tokens_ratio", "output tokens/s"))):
        rates.bar([k + (i - 0.5) * width for k in x], [_get(summary[n], "throughput", key) or math.nan for n in names],
                  width, label=label)
    rates.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    rates.set_title(f"throughput vs {scenario.baseline}", fontsize=9)
    rates.legend(fontsize=7)
    for i, key in enumerate(("mean", "max")):
        gaps.bar([k + (i - 0.5) * width for k in x],
                 [_get(summary[n], "locality", "service_difference", key) or math.nan for n in names], width, label=key)
    gaps.set_title("service difference (units/s; lower is fairer)", fontsize=9)
    gaps.legend(fontsize=7)
    for ax in (hits, rates, gaps):
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=7)
    fig.suptitle(f"{scenario.name}: locality against fairness", fontsize=10)
    _save(fig, path)


def write_outputs(
    out: Path,
    meta: Mapping[str, Any],
    scenarios: Sequence[Scenario],
    arms: Sequence[Arm],
    runs: Mapping[str, Sequence[ArmRun]],
    summaries: Mapping[str, Mapping[str, Any]],
    overhead: Mapping[str, Any] | None,
) -> list[Path]:
    """Write results.json, summary.md and the plots into ``out``; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    results = {"meta": meta, "targets": targets(summaries, arms, overhead), "scenarios": summaries,
               "replays": {s.name: dict(s.replay) for s in scenarios if s.replay}, "overhead": overhead}
    (out / "results.json").write_text(json.dumps(results, indent=1, allow_nan=False), encoding="utf-8")
    (out / "summary.md").write_text(markdown(meta, scenarios, arms, summaries, overhead), encoding="utf-8")
    written += [out / "results.json", out / "summary.md"]
    for scenario in scenarios:
        scenario_runs = runs[scenario.name]
        plot_ttft(scenario, arms, summaries[scenario.name], out / f"{scenario.name}-ttft.png")
        plot_waiting(scenario, scenario_runs, out / f"{scenario.name}-waiting.png")
        plot_service(scenario, scenario_runs, out / f"{scenario.name}-service.png")
        written += [out / f"{scenario.name}-{kind}.png" for kind in ("ttft", "waiting", "service")]
        if LOCALITY in scenario.measures:
            plot_locality(scenario, arms, summaries[scenario.name], out / f"{scenario.name}-locality.png")
            written.append(out / f"{scenario.name}-locality.png")
    return written
