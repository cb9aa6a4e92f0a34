"""What a request costs, for the ``vtc`` policy: estimated at release, measured at the end.

cost = input_weight x uncached prompt tokens + cached_input_weight x cached prompt tokens
     + output_weight x output tokens

The processor sees only the request headers and Envoy's metadata, never the
prompt or the answer (that is what keeps it cheap), so:

At release (estimated)
  * prompt tokens = (Content-Length - body_overhead_bytes) / bytes_per_token
    (defaults 80 and 4: a chat body's JSON structure is about 80 bytes, and 4
    bytes per token is the usual rule of thumb for English text). Without a
    Content-Length (a chunked upload): the tenant's running average prompt,
    else 1.
  * output tokens = ``max_tokens`` (or ``max_completion_tokens``, which wins
    when both are given) when Envoy's json_to_metadata found it in the body;
    otherwise the tenant's running average of measured output, else
    ``default_output_tokens``.
  * each is clamped to ``max_context_tokens`` (the model's context): no
    request can hold more than that, and a client's ``max_tokens: 1e308`` or
    an absurd Content-Length must not make one release cost more than any real
    request could (see Bounds below).

  * cached prompt tokens (models with prefix signatures: ``core/prefix.py``)
    = what the account of the picked endpoint's cache predicts
    (``core/prefix_cache.py``), scaled by how far the engine's own counters
    confirm the account there; 0 without signatures. Always at least one
    prompt token is uncached (the engine recomputes the last one).

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
  * cached prompt tokens: the prediction made at release, scaled again by
    the endpoint's confirmation as it stands at the end (its counters have
    seen the request by then).

  Without a decode rate (engine without the counter, no scrape yet) the
  estimate stands uncorrected.

Bounds
  Every price is finite and between ``input_weight + output_weight`` and
  ``(input_weight + output_weight) x max_context_tokens``, whatever arrives: a
  hostile client picks ``max_tokens`` and Content-Length, a broken engine page
  can report any counter. One infinite charge once made the ``vtc`` floor
  infinite for good (every later tenant then tied at inf with the flooder, and
  lost the tie-break); a tenant whose requests cost nothing would win every
  tie in the same way. So token counts are clamped to ``[1,
  max_context_tokens]`` (a request has at least one prompt token and holds an
  engine slot for at least one output token), NaN counting as 1; a
  non-finite occupancy or decode rate is no measurement, so the estimate
  stands, and the decode rate itself only learns from finite samples.

Pure: times are passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

AVERAGE_WEIGHT = 0.2
# The context length until the engine says its own, when none is configured (a common vLLM --max-model-len).
DEFAULT_CONTEXT_TOKENS = 32_768


@dataclass(frozen=True)
class CostWeights:
    """How a request is priced: input_weight x prompt + output_weight x output tokens."""

    input_weight: float = 1.0
    output_weight: float = 2.0
    # A prompt token the engine found in its prefix cache (no prefill): cheaper.
    cached_input_weight: float = 0.1
    # Prompt tokens are estimated from the request's Content-Length, less the
    # body's JSON structure (model, role, max_tokens...), which is not prompt.
    bytes_per_token: float = 4.0
    body_overhead_bytes: int = 80
    # Output estimate for a tenant's first request without max_tokens.
    default_output_tokens: int = 256
    # The most tokens one request can hold (prompt or output): the engine's
    # context length. Estimates and measurements are clamped to it. None: what
    # the engine says (CostModel.engine_context), DEFAULT_CONTEXT_TOKENS until it does.
    max_context_tokens: int | None = None


def _tokens(value: float, most: float) -> float:
    """A token count clamped to ``[1, most]``; NaN (nothing known) counts as the least, 1."""
    return min(max(value, 1.0), most) if not math.isnan(value) else 1.0


def _cached(prompt_tokens: float, cached: float) -> float:
    """Cached prompt tokens as charged: in ``[0, prompt - 1]`` (one is always recomputed), NaN as none."""
    return min(max(cached, 0.0), prompt_tokens - 1.0) if not math.isnan(cached) else 0.0


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - AVERAGE_WEIGHT) * old + AVERAGE_WEIGHT * new


@dataclass(frozen=True, slots=True)
class Charge:
    """What a finished request costs in the end: its output tokens (measured, else estimated), the price, and its
    prompt tokens charged as cached."""

    output_tokens: float
    cost: float
    cached_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class Estimate:
    """What a release was charged, and what the correction needs to know."""

    prompt_tokens: float
    output_tokens: float
    max_tokens: float | None
    cost: float
    # The client's max_tokens or Content-Length was beyond the context (or not
    # a number): worth a metric, as it is a mistake or an attempt at poisoning.
    clamped: bool = False
    # Prompt tokens charged as cached, and the account's prediction before confirmation (cached_at).
    cached_tokens: float = 0.0
    predicted_cached: float = 0.0


class CostModel:
    """One model's pricing: estimates, measurements, per-tenant averages."""

    def __init__(self, weights: CostWeights) -> None:
        self.weights = weights
        # The largest context an endpoint of the model says it has (its own info endpoint), if any.
        self.engine_context: int | None = None
        self._prompt_avg: dict[str, float] = {}
        self._output_avg: dict[str, float] = {}

    @property
    def context(self) -> int:
        """The clamp on token counts: the configured context length, else the engine's, else the default."""
        return self.weights.max_context_tokens or self.engine_context or DEFAULT_CONTEXT_TOKENS

    def price(self, prompt_tokens: float, output_tokens: float, cached_tokens: float = 0.0) -> float:
        weights = self.weights
        return (weights.input_weight * (prompt_tokens - cached_tokens) + weights.cached_input_weight * cached_tokens
                + weights.output_weight * output_tokens)

    def cached_at(self, estimate: Estimate, predicted: float, confirmed: float) -> Estimate:
        """``estimate`` once released where ``predicted`` prompt tokens are likely cached, ``confirmed`` of them so far."""
        cached = _cached(estimate.prompt_tokens, predicted * confirmed)
        return replace(estimate, cached_tokens=cached, predicted_cached=predicted,
                       cost=self.price(estimate.prompt_tokens, estimate.output_tokens, cached))

    def expect(self, tenant: str, content_length: int | None, max_tokens: float | None) -> tuple[float, float]:
        """The prompt and output tokens :meth:`estimate` would charge, learning nothing (a budget's reservation)."""
        context = float(self.context)
        if content_length is not None:
            prompt = _tokens((content_length - self.weights.body_overhead_bytes) / self.weights.bytes_per_token, context)
        else:
            prompt = _tokens(self._prompt_avg.get(tenant, 1.0), context)
        if max_tokens is not None:
            return prompt, _tokens(max_tokens, context)
        return prompt, self._output_avg.get(tenant, _tokens(self.weights.default_output_tokens, context))

    def estimate(self, tenant: str, content_length: int | None, max_tokens: float | None) -> Estimate:
        """What a release is charged; finite and bounded whatever the client sent (see Bounds)."""
        context = float(self.context)
        prompt, output = self.expect(tenant, content_length, max_tokens)
        clamped = max_tokens is not None and not max_tokens <= context
        if content_length is not None:
            raw_prompt = (content_length - self.weights.body_overhead_bytes) / self.weights.bytes_per_token
            clamped = clamped or not raw_prompt <= context
            self._prompt_avg[tenant] = _blend(self._prompt_avg.get(tenant), prompt)
        return Estimate(prompt, output, None if max_tokens is None else output, self.price(prompt, output), clamped)

    def measure(self, tenant: str, estimate: Estimate, occupancy_s: float, decode_rate: float | None,
                confirmed: float = 1.0) -> Charge:
        """The request's cost as far as it can be measured; ``confirmed``: its endpoint's confirmation now (module docstring)."""
        cached = _cached(estimate.prompt_tokens, estimate.predicted_cached * confirmed)
        if decode_rate is None or not math.isfinite(decode_rate) or not math.isfinite(occupancy_s):
            return Charge(estimate.output_tokens, self.price(estimate.prompt_tokens, estimate.output_tokens, cached), cached)
        output = _tokens(occupancy_s * decode_rate, self.context)
        if estimate.max_tokens is not None:
            output = min(output, estimate.max_tokens)
        self._output_avg[tenant] = _blend(self._output_avg.get(tenant), output)
        return Charge(output, self.price(estimate.prompt_tokens, output, cached), cached)


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
        if at <= then or not generated >= before or not mean_running >= 1:  # `not >=`: NaN fails too
            return
        sample = (generated - before) / (at - then) / mean_running
        if math.isfinite(sample):  # a garbage page (inf, 1e308 counters) must not poison the average
            self.rate = _blend(self.rate, sample)
