"""Reading an engine's queue from its Prometheus ``/metrics`` text.

Parsing is prometheus_client's own text parser; we only cut the exposition
down to the families we read first, because a vLLM ``/metrics`` page is mostly
histograms we do not need and the scrape runs every 100 ms per endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from extproc.gate import EngineLoad


class MetricsError(ValueError):
    """The exposition cannot tell us the engine's queue (missing, garbage, wrong model)."""


@dataclass(frozen=True)
class EngineDialect:
    """Which gauges carry the waiting and running request counts, and the model label."""

    waiting: str
    running: str
    model_label: str
    # Optional cumulative counter of generated tokens (sample name).
    generation_tokens: str | None = None


DIALECTS: dict[str, EngineDialect] = {
    # Names from vLLM's v1 metrics (vllm/v1/metrics/loggers.py).
    "vllm": EngineDialect(
        waiting="vllm:num_requests_waiting",
        running="vllm:num_requests_running",
        model_label="model_name",
        generation_tokens="vllm:generation_tokens_total",
    ),
}


def _relevant(text: str, names: tuple[str, ...]) -> str:
    prefixes = names + tuple(f"# {kind} {n} " for n in names for kind in ("HELP", "TYPE"))
    return "\n".join(line for line in text.splitlines() if line.startswith(prefixes)) + "\n"


def parse_load(engine: str, text: str, model: str) -> EngineLoad:
    """The waiting/running counts that ``text`` reports for ``model``.

    Samples of other models on the same endpoint are ignored; samples without
    the model label count (a single-model engine may omit it).
    """
    dialect = DIALECTS[engine]
    wanted = (dialect.waiting, dialect.running)
    optional = (dialect.generation_tokens,) if dialect.generation_tokens else ()
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(_relevant(text, wanted + optional)):
            for sample in family.samples:
                if sample.name not in wanted + optional:
                    continue
                if sample.labels.get(dialect.model_label, model) != model:
                    continue
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except ValueError as exc:
        raise MetricsError(f"unparseable metrics: {exc}") from exc
    missing = [name for name in wanted if name not in totals]
    if missing:
        raise MetricsError(f"no {', '.join(missing)} for model {model!r}")
    if any(v != v or v < 0 for v in totals.values()):  # NaN or negative: not a queue length
        raise MetricsError(f"implausible values {totals}")
    generated = totals.get(dialect.generation_tokens) if dialect.generation_tokens else None
    return EngineLoad(waiting=totals[dialect.waiting], running=totals[dialect.running], generation_tokens=generated)
