"""What a model's dispatcher reports as it works: the one interface the core writes telemetry through.

The core calls these methods and knows nothing of Prometheus; the adapter
(``telemetry.ModelTelemetry``) turns each call into its series. Bands are
named by their priority class; the model is the reporter's own. Tenants are
passed as the client's tenant id: bounding what becomes a label value is the
adapter's business, not the scheduler's.
"""

from __future__ import annotations

from typing import Protocol

from extproc.core.engine_load import EngineLoad
from extproc.core.outcomes import Refusal


class DispatchReport(Protocol):
    def refused(self, refusal: Refusal, tenant: str) -> None:
        """A request was refused (a queue cap, its queue timeout, or the drain)."""

    def held(self, band: str, tenant: str, waited_s: float) -> None:
        """A request left the queue, released or timed out, after ``waited_s``."""

    def released(self, band: str, tenant: str) -> None: ...

    def charged(self, tenant: str, prompt_tokens: float, output_tokens: float, cost: float) -> None:
        """A released request ended; what it was charged in the end (``cost.py``: estimate, then correction)."""

    def decision(self, seconds: float) -> None:
        """How long the dispatcher took to take in one arrival (caps, estimate, queue, dispatch)."""

    def cost_clamped(self) -> None:
        """A request's max_tokens or Content-Length was beyond the model's context; its cost was clamped."""

    def abandoned(self, band: str, tenant: str) -> None:
        """A queued request's client left."""

    def queued(self, band: str, tenant: str, change: int) -> None:
        """A request of ``tenant`` entered (+1) or left (-1) the queue of ``band``."""

    def in_flight(self, count: int) -> None:
        """Released requests whose responses have not finished."""

    def scraped(self, endpoint: str, load: EngineLoad, itl_s: float | None, limit: float | None) -> None:
        """A good scrape, and what the release rule shows for the endpoint now (None: the rule has no such number)."""

    def scrape_failed(self, endpoint: str) -> None: ...

    def endpoint_left(self, endpoint: str) -> None:
        """The endpoint left the pool: forget what was reported about it."""

    def endpoint_degraded(self, endpoint: str, degraded: bool) -> None:
        """The endpoint's metrics became unusable (True) or usable again (False)."""

    def endpoint_up(self, endpoint: str, up: bool) -> None:
        """The endpoint's engine became unreachable (False: nothing is released to it) or reachable again."""

    def release_failed(self, endpoint: str | None) -> None:
        """A released request failed before the engine answered it (or the engine answered 503).

        ``endpoint`` is None where the pool cannot tell which endpoint it went to.
        """

    def decided(self, tenant: str, band: str, waited_s: float, outcome: str) -> None:
        """How one request's time in the queue ended, once per request that reached the queue.

        ``outcome``: ``released``, ``refused:<reason>`` (a Refusal's value) or
        ``abandoned``. Called on the hot path: an adapter that does nothing
        with it must return at once.
        """

    def fallback(self, active: bool) -> None:
        """The model's gate runs on fallback limits (some endpoint degraded) or not."""
