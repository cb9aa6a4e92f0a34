"""What a model's dispatcher reports as it works: the one interface the core writes telemetry through.

The core calls these methods and knows nothing of Prometheus; the adapter
(``telemetry.ModelTelemetry``) turns each call into its series. Bands are
named by their priority class; the model is the reporter's own.
"""

from __future__ import annotations

from typing import Protocol

from extproc.core.engine_load import EngineLoad
from extproc.core.outcomes import Refusal


class DispatchReport(Protocol):
    def refused(self, refusal: Refusal) -> None:
        """A request was refused (a queue cap or its queue timeout)."""

    def held(self, band: str, waited_s: float) -> None:
        """A request left the queue, released or timed out, after ``waited_s``."""

    def released(self, band: str) -> None: ...

    def cost_clamped(self) -> None:
        """A request's max_tokens or Content-Length was beyond the model's context; its cost was clamped."""

    def abandoned(self, band: str) -> None:
        """A queued request's client left."""

    def queue_depth(self, band: str, depth: int) -> None: ...

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
