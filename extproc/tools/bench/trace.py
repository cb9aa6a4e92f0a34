"""A production trace replayed as a benchmark plan: the Azure LLM inference trace 2023 (``extproc-dev bench --trace``).

The trace (Azure/AzurePublicDataset, CC BY 4.0; Patel et al., "Splitwise",
ISCA 2024) lists one request a row, ``TIMESTAMP,ContextTokens,GeneratedTokens``:
its arrival as absolute wall time with 7 fractional digits (100 ns; Python's
datetime keeps 6, so :func:`parse_timestamp` reads the fraction itself), its
prompt tokens and its generated tokens. Two files, two kinds of work:

* ``conv`` rows are chats: the ``interactive`` class, spread over 20 tenants;
* ``code`` rows are coding-assistant completions: ``standard`` work of 5 tenants.

Each row's tenant is drawn uniformly, seeded per kind, so the same trace and
seed give the same plan. A window of the trace (``start``, ``seconds`` of trace
time) is replayed; beside it ``batchjob``, allowed the batch class only, sends
:data:`FLOOD` non-streamed completions at once :data:`FLOOD_AT` model seconds in.

**Compression.** The trace's time is multiplied by one factor so that its
offered work is ``utilisation`` of the simulated engine's capacity over the
replayed span. A request's work is the engine time it costs at a full batch
(the simulator's model, :mod:`extproc.tools.sim.engine`): its prompt's prefill
(``prefill_ms_per_token`` a token, which stalls the whole batch) plus its share
of the decode steps of a full batch (``step_ms + step_ms_per_seq * max_num_seqs``
per step, one token for each of ``max_num_seqs`` requests). Capacity is one
engine second per second, so ``factor = work / (utilisation * seconds)``: above 1
the trace is stretched, below 1 compressed. The flood comes on top.

**Clipping.** The simulated engine refuses a request whose prompt plus answer
exceeds its ``kv_cache_tokens`` (its maximum context): such a row's prompt is cut
first (its answer is what its client waits for), then its answer.

Every factor used goes into the scenario's ``replay`` (results.json ``replays``).
"""

from __future__ import annotations

import calendar
import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import numpy as np

from extproc.tools.bench.arms import PRIORITY_QUEUE_ARMS
from extproc.tools.bench.load import LogNormal, Planned, Stream
from extproc.tools.bench.scenarios import (
    BATCH_ONLY_TENANT,
    TRACE,
    TRACE_ALONE,
    UNLOADED,
    Engine,
    Phase,
    Scenario,
    class_focus,
)

HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
TICKS_PER_S = 10_000_000  # the trace's resolution: 100 ns
SOURCE = ("Azure LLM inference trace 2023 (github.com/Azure/AzurePublicDataset, "
          "commit b469a113cedca53ddc3bdea71a143dc4b7d8700c), CC BY 4.0; Patel et al., "
          "\"Splitwise: Efficient generative LLM inference using phase splitting\", ISCA 2024")


class TraceError(ValueError):
    """A trace file that cannot be replayed, with the file (and line) to look at."""


@dataclass(frozen=True)
class Kind:
    """What a trace file's rows are replayed as: their class and the tenants they are spread over."""

    name: str
    priority: str
    tenants: int
    prefix: str

    def tenant(self, number: int) -> str:
        return f"{self.prefix}{number + 1:0{len(str(self.tenants))}d}"

    @property
    def names(self) -> list[str]:
        return [self.tenant(n) for n in range(self.tenants)]


KINDS = {
    "conv": Kind("conv", "interactive", 20, "chat"),
    "code": Kind("code", "standard", 5, "code"),
}

# The bundled slices (extproc/tools/bench/traces/README.md: provenance, lines kept, licence, citation).
TRACES = resources.files("extproc.tools.bench") / "traces"
PROFILES: dict[str, tuple[tuple[str, str], ...]] = {
    "azure2023": (("conv", "azure2023_conv_20231116_1846-1848.csv"), ("code", "azure2023_code_20231116_1846-1848.csv")),
}
DEFAULT_PROFILE = "azure2023"
# The default window: 20 s of the bundled slices in which both kinds send throughout (the longest gap
# between code rows is 2.6 s; whole minutes of the code file have none). At the default engine and
# utilisation it becomes ~100 model seconds.
DEFAULT_START = "2023-11-16 18:46:25"
DEFAULT_SECONDS = 20.0
# The replay runs in real time (time scale 1) unless --quick: what it measures is how much of the engine
# the gateway leaves unused, and at 0.25 every millisecond of the gateway's own reaction (a release, a
# scrape) would weigh four times more against the engine than on a real one.
TIME_SCALE = 1.0
DEFAULT_UTILISATION = 0.87

# The batch flood: a document-summarising job, non-streamed, beside the trace.
FLOOD_TENANT = "batchjob"
FLOOD = 300
FLOOD_AT = 10.0
FLOOD_PROMPT_TOKENS = 512
FLOOD_OUTPUT_TOKENS = 128
# After the replayed span, this long for answers (model seconds): the standard class's TTFT objective, so a
# request sent last still has its class's objective to be answered in. What is not answered by then is cut.
DRAIN_S = 60.0
SEED = 23

# `--quick --trace`: a few seconds of trace, a small flood and a short drain (CI smoke runs).
QUICK_SECONDS = 2.0
QUICK_FLOOD = 24
QUICK_FLOOD_AT = 2.0
QUICK_DRAIN_S = 5.0

# Straight to the engine (its FIFO queue, its priority queue) and the gateway in front of each.
TRACE_ARMS = PRIORITY_QUEUE_ARMS
# `--quick --trace` (CI's smoke run): the reference and the gateway that learns the engine's priority queue.
QUICK_TRACE_ARMS = ("direct-fifo", "direct-priority", "extproc-engine-priority")


@dataclass(frozen=True)
class Row:
    """One request of a trace: its arrival (100 ns ticks), its prompt and generated tokens, its line in its file."""

    at: int
    prompt_tokens: int
    output_tokens: int
    line: int


@dataclass(frozen=True)
class Source:
    """One trace file, the kind of its rows, and its name in the results (a bundled slice: ``profile:file``)."""

    kind: str
    path: Path | Traversable
    label: str


def parse_timestamp(text: str) -> int:
    """``YYYY-MM-DD HH:MM:SS[.fffffff]`` as 100 ns ticks since 1970 (the trace states no zone: read as UTC).

    Up to 7 fractional digits, all kept (datetime would drop the 7th).
    """
    whole, _, fraction = text.strip().partition(".")
    if len(fraction) > 7 or (fraction and not fraction.isdigit()):
        raise ValueError(f"bad fraction of a second in {text!r} (at most 7 digits)")
    moment = datetime.datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    return calendar.timegm(moment.timetuple()) * TICKS_PER_S + int(fraction.ljust(7, "0") or 0)


def format_ticks(ticks: int) -> str:
    """The inverse of :func:`parse_timestamp`: 7 fractional digits."""
    seconds, rest = divmod(ticks, TICKS_PER_S)
    moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    return f"{moment:%Y-%m-%d %H:%M:%S}.{rest:07d}"


def parse_rows(lines: Iterable[str], name: str) -> list[Row]:
    """The rows of a trace file's ``lines``: its header first, then one request a line (empty lines skipped)."""
    rows: list[Row] = []
    header_seen = False
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line:
            continue
        fields = [f.strip() for f in line.split(",")]
        if not header_seen:
            if tuple(fields) != HEADER:
                raise TraceError(f"{name}:{number}: expected the header {','.join(HEADER)}, found {line!r}")
            header_seen = True
            continue
        try:
            if len(fields) != 3:
                raise ValueError(f"{len(fields)} fields, not 3")
            row = Row(parse_timestamp(fields[0]), int(fields[1]), int(fields[2]), number)
        except ValueError as exc:
            raise TraceError(f"{name}:{number}: {exc}") from None
        if row.prompt_tokens < 0 or row.output_tokens < 0:
            raise TraceError(f"{name}:{number}: negative token count in {line!r}")
        rows.append(row)
    if not header_seen:
        raise TraceError(f"{name}: empty, expected the header {','.join(HEADER)}")
    return rows


def read_rows(source: Source) -> list[Row]:
    try:
        text = source.path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{source.label}: {exc.strerror or exc}") from None
    return parse_rows(text.splitlines(), source.label)


def sources(names: Sequence[str]) -> list[Source]:
    """The files ``--trace`` names: a bundled profile (``azure2023``), ``KIND=FILE``, or a FILE named after its kind.

    A file's kind is ``conv`` or ``code``: given before ``=``, else the one its name contains.
    """
    found: list[Source] = []
    for name in names:
        if name in PROFILES:
            found += [Source(kind, TRACES / file, f"{name}:{file}") for kind, file in PROFILES[name]]
            continue
        kind, eq, path = name.partition("=")
        if eq and kind in KINDS:
            found.append(Source(kind, Path(path), path))
            continue
        named = [k for k in KINDS if k in Path(name).name]
        if len(named) != 1:
            raise TraceError(f"{name}: not a profile ({', '.join(PROFILES)}), and its name does not say whether its "
                             f"rows are {' or '.join(KINDS)}: write {'=FILE or '.join(KINDS)}=FILE")
        found.append(Source(named[0], Path(name), name))
    return found


def clip(prompt: int, output: int, context: int) -> tuple[int, int]:
    """Token counts the engine accepts: prompt + output <= ``context``, each at least 1; the prompt is cut first."""
    output = max(1, min(output, context - 1))
    return max(1, min(prompt, context - output)), output


def engine_seconds(prompt: int, output: int, engine: Engine) -> float:
    """The engine time a request costs at a full batch (model seconds): its prefill and its share of the steps."""
    step_ms = engine.step_ms + engine.step_ms_per_seq * engine.max_num_seqs
    return (engine.prefill_ms_per_token * prompt + output * step_ms / engine.max_num_seqs) / 1000


def time_factor(work_s: float, seconds: float, utilisation: float) -> float:
    """Model seconds per trace second that make ``work_s`` of engine time over ``seconds`` of trace ``utilisation``."""
    if work_s <= 0 or seconds <= 0 or utilisation <= 0:
        raise TraceError("nothing to replay: the window has no work, or the utilisation is not positive")
    return work_s / (utilisation * seconds)


def assign_tenants(count: int, kind: Kind, seed: int) -> list[str]:
    """A tenant of ``kind`` for each of ``count`` rows, uniformly at random; the same seed gives the same list."""
    rng = np.random.default_rng([seed, list(KINDS).index(kind.name)])
    return [kind.tenant(int(n)) for n in rng.integers(0, kind.tenants, count)]


def window_start(text: str | None, rows: Iterable[Row]) -> int:
    """The window's start in ticks: a TIMESTAMP, or seconds after the earliest row (None: the default)."""
    if text is None:
        return parse_timestamp(DEFAULT_START)
    try:
        offset = float(text)
    except ValueError:
        try:
            return parse_timestamp(text)
        except ValueError as exc:
            raise TraceError(f"--trace-start {text!r}: neither seconds nor a TIMESTAMP ({exc})") from None
    first = min((r.at for r in rows), default=0)
    return first + round(offset * TICKS_PER_S)


@dataclass(frozen=True)
class Replay:
    """A window of trace rows as planned requests, and what it took (see the module docstring)."""

    requests: tuple[Planned, ...]
    factors: dict[str, Any]


def replay_rows(
    files: Sequence[tuple[Source, Sequence[Row]]], *, start: int, seconds: float, engine: Engine, utilisation: float,
    seed: int = SEED,
) -> Replay:
    """The rows of ``files`` in [start, start + seconds), clipped, tenants assigned, time multiplied to the load."""
    end = start + round(seconds * TICKS_PER_S)
    context = engine.kv_cache_tokens
    picked: dict[str, list[tuple[Source, Row, int, int]]] = {kind: [] for kind in KINDS}
    described: list[dict[str, Any]] = []
    for source, rows in files:
        inside = [r for r in rows if start <= r.at < end]
        if not inside:
            raise TraceError(f"{source.label}: no row between {format_ticks(start)} and {format_ticks(end)} "
                             "(choose the window with --trace-start and --trace-seconds)")
        clipped = [(source, r, *clip(r.prompt_tokens, r.output_tokens, context)) for r in inside]
        picked[source.kind] += clipped
        described.append({
            "file": source.label, "kind": source.kind, "class": KINDS[source.kind].priority,
            "rows": len(inside), "lines": [inside[0].line, inside[-1].line],
            "first_row": format_ticks(inside[0].at), "last_row": format_ticks(inside[-1].at),
            "clipped_rows": sum((p, o) != (r.prompt_tokens, r.output_tokens) for _, r, p, o in clipped),
            "prompt_tokens": sum(p for *_, p, _ in clipped), "output_tokens": sum(o for *_, o in clipped),
            "engine_s": sum(engine_seconds(p, o, engine) for *_, p, o in clipped),
        })
    work = sum(d["engine_s"] for d in described)
    factor = time_factor(work, seconds, utilisation)
    span = seconds * factor
    requests: list[Planned] = []
    kinds: dict[str, Any] = {}
    for name, rows_of_kind in picked.items():
        if not rows_of_kind:
            continue
        kind = KINDS[name]
        rows_of_kind.sort(key=lambda item: item[1].at)  # several files of one kind: merged by time
        tenants = assign_tenants(len(rows_of_kind), kind, seed)
        requests += [Planned((row.at - start) / TICKS_PER_S * factor, tenant, kind.priority, prompt, output)
                     for (_, row, prompt, output), tenant in zip(rows_of_kind, tenants, strict=True)]
        kind_work = sum(engine_seconds(p, o, engine) for *_, p, o in rows_of_kind)
        kinds[name] = {"class": kind.priority, "tenants": kind.names, "requests": len(rows_of_kind),
                       "engine_s": kind_work, "offered_utilisation": kind_work / span}
    factors = {
        "source": SOURCE,
        "files": described,
        "window": {"start": format_ticks(start), "seconds": seconds},
        "kinds": kinds,
        "tenant_seed": seed,
        "max_context_tokens": context,
        "clipped_rows": sum(d["clipped_rows"] for d in described),
        "work_model": {"prefill_ms_per_token": engine.prefill_ms_per_token, "full_batch": engine.max_num_seqs,
                       "full_batch_step_ms": engine.step_ms + engine.step_ms_per_seq * engine.max_num_seqs},
        "engine_s": work,
        "utilisation": utilisation,
        "time_factor": factor,
        "span_s": span,
        "offered_utilisation": work / span,
    }
    return Replay(tuple(sorted(requests, key=lambda r: r.at)), factors)


def trace_replay(
    files: Sequence[Source], *, engine: Engine, utilisation: float = DEFAULT_UTILISATION, start: str | None = None,
    seconds: float | None = None, quick: bool = False, arms: tuple[str, ...] = TRACE_ARMS, seed: int = SEED,
) -> Scenario:
    """The ``trace`` scenario: a window of ``files`` replayed at ``utilisation``, a batch flood, a window to answer in.

    Phases on ``direct-fifo`` first: the chats alone (the interactive class's
    quiet-engine reference) and the trace without the flood (its offered load
    measured: the engine's mean running / slots against ``utilisation``).
    ``quick``: a few seconds of trace, a small flood, a short drain.
    """
    if not files:
        raise TraceError("no trace file")
    if not 0 < utilisation <= 2:
        raise TraceError(f"--utilisation {utilisation:g}: expected a share of the engine's capacity in (0, 2]")
    read = [(source, read_rows(source)) for source in files]
    first = window_start(start, (r for _, rows in read for r in rows))
    seconds = seconds if seconds is not None else QUICK_SECONDS if quick else DEFAULT_SECONDS
    if seconds <= 0:
        raise TraceError(f"--trace-seconds {seconds:g}: expected a positive length of trace")
    replay = replay_rows(read, start=first, seconds=seconds, engine=engine, utilisation=utilisation, seed=seed)
    flood, flood_at, drain = (QUICK_FLOOD, QUICK_FLOOD_AT, QUICK_DRAIN_S) if quick else (FLOOD, FLOOD_AT, DRAIN_S)
    if quick and arms == TRACE_ARMS:
        arms = QUICK_TRACE_ARMS
    span = replay.factors["span_s"]
    prompt, output = clip(FLOOD_PROMPT_TOKENS, FLOOD_OUTPUT_TOKENS, engine.kv_cache_tokens)
    job = Stream(FLOOD_TENANT, LogNormal(prompt, 0.0), LogNormal(output, 0.0), burst=flood, start=flood_at,
                 priority="batch", stream=False)
    kinds = replay.factors["kinds"]
    chats = frozenset(kinds.get("conv", {}).get("tenants", ()))
    traced = frozenset(t for k in kinds.values() for t in k["tenants"])
    factors = {
        **replay.factors,
        "flood": {"tenant": FLOOD_TENANT, "class": "batch", "requests": flood, "at_s": flood_at,
                  "prompt_tokens": prompt, "output_tokens": output, "stream": False,
                  "engine_s": flood * engine_seconds(prompt, output, engine)},
        "drain_s": drain,
        "window_s": span + drain,
    }
    who = ", ".join(f"{k['requests']} {name} rows as {k['class']} ({len(k['tenants'])} tenants)"
                    for name, k in kinds.items())
    return Scenario(
        name="trace",
        description=f"the Azure LLM inference trace 2023 from {factors['window']['start'][:19]}, {seconds:g} s of it: "
        f"{who}, time x {replay.factors['time_factor']:.2f} (offered load {utilisation:g} of the engine); "
        f"{FLOOD_TENANT} (batch class only) sends {flood} non-streamed completions ({prompt}-token prompts, "
        f"{output}-token answers) at once {flood_at:g} s in; the window: the replayed {span:.0f} s + {drain:g} s",
        streams=(job,),
        planned=replay.requests,
        **class_focus("interactive"),
        seed=seed,
        arms=arms,
        phases=(Phase(UNLOADED, chats, arms=("direct-fifo",)), Phase(TRACE_ALONE, traced, arms=("direct-fifo",))),
        engine=engine,
        time_scale=None if quick else TIME_SCALE,
        gateway={"tenants": {FLOOD_TENANT: BATCH_ONLY_TENANT}},
        measures=frozenset({TRACE}),
        window=span + drain,
        replay=factors,
    )


def describe(factors: Mapping[str, Any]) -> str:
    """One paragraph for summary.md: what was replayed, and every factor used."""
    files = "; ".join(f"{f['file']} lines {f['lines'][0]}–{f['lines'][1]} ({f['rows']} rows, {f['kind']} as "
                      f"{f['class']}, {f['clipped_rows']} clipped)" for f in factors["files"])
    flood = factors["flood"]
    return (f"Replayed: {factors['source']}. Window {factors['window']['start']} + {factors['window']['seconds']:g} s: "
            f"{files}. Offered work {factors['engine_s']:.1f} engine-s (prefill "
            f"{factors['work_model']['prefill_ms_per_token']:g} ms a prompt token, decode "
            f"{factors['work_model']['full_batch_step_ms']:g} ms a step of {factors['work_model']['full_batch']}), "
            f"time x {factors['time_factor']:.3f}: {factors['span_s']:.1f} model s, utilisation "
            f"{factors['offered_utilisation']:.2f}; prompt + answer clipped to {factors['max_context_tokens']} tokens; "
            f"tenants seeded {factors['tenant_seed']}. Flood: {flood['requests']} x ({flood['prompt_tokens']} + "
            f"{flood['output_tokens']} tokens) at {flood['at_s']:g} s, {flood['engine_s']:.1f} engine-s more. Window "
            f"{factors['window_s']:.1f} s (span + {factors['drain_s']:g} s to drain).")
