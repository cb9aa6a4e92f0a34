"""``extproc-dev bench --engine vllm``: the fairness and priority scenarios on a real vLLM (CPU build).

The simulator is what we believe an engine does; this is what vLLM does: its
scheduler, its FIFO (or ``--scheduling-policy priority``), its ``/metrics``
with their lag. Every arm gets a fresh vLLM server (no prefix cache or
counters carried over) started by :func:`extproc.tools.realvllm.start_vllm`, serving
the tiny local model with a batch of :data:`MAX_NUM_SEQS`, or with
:data:`PREFILL` the prefill-size one, whose 4,096-token context and costly
prefill make vLLM's prefix cache matter (an uncached 2,000-token prompt
reaches its first token ~8x later than the same prompt cached).

The scenarios are the simulator's, sized for this engine: the tiny model's
context is 512 tokens, and on 2 cores, beside Envoy, the processor and the
load generator, vLLM CPU serves only a few such requests a second, so the
floods are small. ``batch-flood`` and ``batch-only`` are the very ones the
simulator runs on its vLLM-like GPU (``scenarios.VLLM_LIKE``). Times are real
seconds (time scale 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from extproc.tools.bench import scenarios
from extproc.tools.bench.arms import ARMS as SIM_ARMS
from extproc.tools.bench.arms import DIRECT, DIRECT_PRIORITY, TARGET_WAITING, TIGHT_OBJECTIVE, TIGHT_OBJECTIVE_S, Arm
from extproc.tools.bench.scenarios import Scenario
from extproc.tools.procs import ManagedProcess
from extproc.tools.realvllm import REQUEST_EXTRAS, ModelSize, SchedulingPolicy, start_vllm

MAX_NUM_SEQS = 4


@dataclass(frozen=True)
class VllmEngine:
    """A real vLLM server per arm (see the module docstring)."""

    max_num_seqs: int = MAX_NUM_SEQS
    size: ModelSize = "tiny"
    # The KV cache in tokens; None: max_num_seqs full contexts (room beyond that keeps more prefixes cached).
    kv_cache_tokens: int | None = None
    # The models' BPE tokenizer (the same for both sizes) reads the bench's filler text at ~2 characters a
    # token (measured: 1,125 characters, 576 tokens).
    chars_per_token: int = 2
    request_extras: Mapping[str, Any] = field(default_factory=lambda: dict(REQUEST_EXTRAS))

    async def start(self, model: str, endpoint: str, workdir: Path, policy: SchedulingPolicy) -> ManagedProcess:
        port = int(endpoint.rsplit(":", 1)[1])
        return await start_vllm(model, port, workdir, max_num_seqs=self.max_num_seqs, scheduling_policy=policy,
                                size=self.size, kv_cache_tokens=self.kv_cache_tokens)


# For prefix caching: 4 sequences of up to 4,096 tokens, and their 16,384 tokens of KV cache.
PREFILL = VllmEngine(size="prefill")


# Prompt plus answer stay within the 512-token context (with the chat template's few tokens).
SIZES = scenarios.TINY_SIZES

# The operator knows vLLM's --max-num-seqs and says so (docs/real-vllm.md).
_KNOWN_BATCH = {"max_running": MAX_NUM_SEQS, "target_waiting": TARGET_WAITING}
ENVOY = next(a for a in SIM_ARMS if a.name == "envoy")
ARMS: tuple[Arm, ...] = (
    DIRECT,
    DIRECT_PRIORITY,
    ENVOY,
    Arm("extproc-rr", "extproc", "Envoy + extproc, round-robin per tenant, adaptive gate; vLLM fcfs",
        model=_KNOWN_BATCH),
    Arm("extproc-no-preempt", "extproc", "as extproc-rr with preemption off (max_preemptions_per_s: 0)",
        model={**_KNOWN_BATCH, "max_preemptions_per_s": 0}),
    Arm("extproc-preempt", "extproc",
        "as extproc-rr, preempting batch requests for interactive ones (max_preemptions_per_s: 2, the default)",
        model={**_KNOWN_BATCH, "max_preemptions_per_s": 2}),
    Arm("extproc-preempt-tight", "extproc",
        f"as extproc-preempt, with interactive's objective at {TIGHT_OBJECTIVE_S:g} s instead of 5 s",
        model={**_KNOWN_BATCH, "max_preemptions_per_s": 2}, top=TIGHT_OBJECTIVE),
    Arm("extproc-engine-priority", "extproc",
        "as extproc-rr, with engine_priority: true and vLLM --scheduling-policy priority",
        model={**_KNOWN_BATCH, "engine_priority": True}, scheduling_policy="priority"),
    Arm("extproc-priority-reserve", "extproc",
        "as extproc-engine-priority, and batch runs in at most 3 of the 4 slots (idle_running_share 0.75): "
        "a slot stays free for an interactive arrival",
        model={**_KNOWN_BATCH, "engine_priority": True}, scheduling_policy="priority",
        top={"bands": {"batch": {"idle_running_share": 0.75}}}),
    Arm("extproc-vtc", "extproc", "Envoy + extproc, cost-weighted fair queueing (vtc), adaptive gate",
        model={**_KNOWN_BATCH, "policy": "vtc"}),
    Arm("extproc-locality", "extproc", "Envoy + extproc, policy: locality (prefix-cache aware within a deficit quantum)",
        model={**_KNOWN_BATCH, "policy": "locality"}),
    Arm("extproc-priority-reserve-2", "extproc",
        "as extproc-priority-reserve with two slots kept free (idle_running_share 0.5)",
        model={**_KNOWN_BATCH, "engine_priority": True}, scheduling_policy="priority",
        top={"bands": {"batch": {"idle_running_share": 0.5}}}),
)


# The policy comparison's arms (prefix-share), not the priority comparison's.
_POLICY_ARMS = ("extproc-vtc", "extproc-locality")


def power_user() -> Scenario:
    return scenarios.power_user(60, newcomers_at=1.0, sizes=SIZES, arms=("direct-fifo", "extproc-rr"))


def priority_mix() -> Scenario:
    return scenarios.priority_mix(120, flood_at=10.0, duration=40.0, users=8, sizes=SIZES,
                                  arms=tuple(a.name for a in ARMS if a.gateway != "envoy" and a.name not in _POLICY_ARMS))


def steady_classes() -> Scenario:
    # About 40% of this engine's 4 slots.
    return scenarios.steady_classes(40.0, sizes=SIZES, load=1.5)


def prefix_share(replicas: int) -> Scenario:
    """Prefix locality on the prefill-size model: its 2,000-token documents take ~0.6 s to prefill uncached, ~0.08 s cached."""
    return scenarios.prefix_share(
        replicas, duration=40.0, documents=6, document_tokens=1500, rag_rate=0.5, chats=4, chat_rate=0.3, flood=40,
        engine=replace(scenarios.PREFILL_HEAVY, block_size=128), vllm_engine=PREFILL,
        arms=("direct-fifo", "envoy", "extproc-rr", "extproc-vtc", "extproc-locality"),
    )


SCENARIOS = {s.name: s for s in (
    power_user(), priority_mix(), scenarios.batch_flood(), steady_classes(),
    scenarios.batch_only(), prefix_share(1), prefix_share(2),
)}
