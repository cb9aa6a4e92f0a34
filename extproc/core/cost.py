"""What a request costs, for the ``vtc`` policy: estimated at release, measured at the end.

cost = input_weight x prompt tokens + output_weight x output tokens

The processor sees only the request headers and Envoy's metadata, never the
prompt or the answer (that is what keeps it cheap), so:

At release (estimated)
  * prompt tokens = (Content-Length - body_overhead_bytes) / bytes_per_token
    (defaults 80 and 4: a chat body's JSON structure is about 80 bytes, and 4
    bytes per token is the usual rule of thumb for English text). Without a
    Content-Length (a chunked upload): the tenant's running average prompt,
    else 0.
  * output tokens = ``max_tokens`` (or ``max_completion_tokens``) when Envoy's
    json_to_metadata found it in the body; otherwise the tenant's running
    average of measured output, else ``default_output_tokens``.

At completion (measured, then derived)
  * **measured**: the request's occupancy of the engine — from our release to
    the end of its ext_proc stream (the response's last byte, or the client
    leaving) — and the engine's decode rate per running sequence, from the
    growth of its generated-token counter (``vllm:generation_tokens_total``)
    divided by its running requests between two scrapes.
  * **derived**: output tokens = occupancy x decode rate, capped by
    ``max_tokens``. Occupancy includes the engine queue and prefill, so this
    errs high; the cap keeps it honest for requests that ran to their limit,
    and a request that stopped early or whose client left is charged for
    what it used.
  * prompt tokens stay estimated: usage per request would need the response
    body, which is deliberately never sent to the processor.

  Without a decode rate (engine without the counter, no scrape yet) the
  estimate stands uncorrected.

The tenant averages (exponentially weighted, weight ``AVERAGE_WEIGHT`` for
the newest) learn from these derived values.

Pure: times are passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

AVERAGE_WEIGHT = 0.2


@dataclass(frozen=True)
class CostWeights:
    """How a request is priced: input_weight x prompt + output_weight x output tokens."""

    input_weight: float = 1.0
    output_weight: float = 2.0
    # Prompt tokens are estimated from the request's Content-Length, less the
    # body's JSON structure (model, role, max_tokens...), which is not prompt.
    bytes_per_token: float = 4.0
    body_overhead_bytes: int = 80
    # Output estimate for a tenant's first request without max_tokens.
    default_output_tokens: int = 256


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - AVERAGE_WEIGHT) * old + AVERAGE_WEIGHT * new


@dataclass(frozen=True)
class Estimate:
    """What a release was charged, and what the correction needs to know."""

    prompt_tokens: float
    output_tokens: float
    max_tokens: float | None
    cost: float


class CostModel:
    """One model's pricing: estimates, measurements, per-tenant averages."""

    def __init__(self, weights: CostWeights) -> None:
        self._weights = weights
        self._prompt_avg: dict[str, float] = {}
        self._output_avg: dict[str, float] = {}

    def price(self, prompt_tokens: float, output_tokens: float) -> float:
        return self._weights.input_weight * prompt_tokens + self._weights.output_weight * output_tokens

    def estimate(self, tenant: str, content_length: int | None, max_tokens: float | None) -> Estimate:
        if content_length is not None:
            prompt = max(0, content_length - self._weights.body_overhead_bytes) / self._weights.bytes_per_token
            self._prompt_avg[tenant] = _blend(self._prompt_avg.get(tenant), prompt)
        else:
            prompt = self._prompt_avg.get(tenant, 0.0)
        if max_tokens is not None:
            output = max_tokens
        else:
            output = self._output_avg.get(tenant, float(self._weights.default_output_tokens))
        return Estimate(prompt, output, max_tokens, self.price(prompt, output))

    def measure(self, tenant: str, estimate: Estimate, occupancy_s: float, decode_rate: float | None) -> float:
        """The request's cost as far as it can be measured (see the module docstring)."""
        if decode_rate is None:
            return estimate.cost
        output = occupancy_s * decode_rate
        if estimate.max_tokens is not None:
            output = min(output, estimate.max_tokens)
        self._output_avg[tenant] = _blend(self._output_avg.get(tenant), output)
        return self.price(estimate.prompt_tokens, output)


class DecodeRate:
    """Tokens per second that one running sequence gets, from the engine's counters.

    Every running sequence gains one token per engine step, so the counter's
    growth divided by the running requests is the step rate. Samples from all
    endpoints of a model feed one exponentially weighted average.
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float, float]] = {}
        self.rate: float | None = None

    def record(self, endpoint: str, generated: float | None, running: float, at: float) -> None:
        previous = self._last.pop(endpoint, None)
        if generated is None:
            return
        self._last[endpoint] = (generated, running, at)
        if previous is None:
            return
        before, running_before, then = previous
        mean_running = (running + running_before) / 2
        # A counter that went down is an engine restart; nothing running says nothing.
        if at <= then or generated < before or mean_running < 1:
            return
        self.rate = _blend(self.rate, (generated - before) / (at - then) / mean_running)
