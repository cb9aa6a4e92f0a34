"""Per-model loop between held requests, the fair queue and the release side.

Each held request is an ``asyncio.Future`` that the ext_proc stream awaits.
Dispatch — pop from the fair queue while the band's allowance lasts — runs
only when something changed: a request arrived, a response finished, a scrape
reported (or, for a rate, the next release fell due). There is no polling
loop; an idle model costs nothing.

Every request that enters ends exactly one way: released (future result),
refused (future exception :class:`~extproc.core.values.outcomes.Refused`), or
abandoned (its client left: the stream's task was cancelled and the entry is
removed at once). A request over a queue cap is refused before it enters
(``submit`` raises). Outcomes are named here; what the client hears is the
ext_proc adapter's choice.

The dispatcher decides nothing itself and keeps no state of its own: it
routes each event to the part that owns what it changes, and answers the
adapters' questions. The model's state (``model_state.py``) owns the queue,
the bands and their demand, the preemption book and the pricing; the pool
gets the engines' events (scrapes, probes, membership, outcomes), reported as
it then stands (``release/pool_report.py``); the release strategy
(``strategy.py``: this instance alone, or a seat of a cluster, ``cluster.py``)
decides what goes. Which request goes next is ``fair_queue.py`` and the
band's policy (``policies/``); how many, ``bands.py`` above the release rule
(``release/``); where, ``release/pool.py``.

It takes plain values (built by ``adapters/wiring.py`` from the config),
reports through :class:`~extproc.core.values.report.DispatchReport`, and leaves its
deadlines (a queued request's longest wait, a rate's next release) to the
injected :class:`~extproc.core.timers.Timers`: the core keeps no event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from extproc.core.bands import Band
from extproc.core.cost import CostWeights
from extproc.core.demand import Demand
from extproc.core.entitlement import Tenant
from extproc.core.held import Held, Request
from extproc.core.model_state import LiveSettings, ModelState
from extproc.core.policies import Policy
from extproc.core.prefix import NO_PREFIX, Prefix
from extproc.core.release.answer import Answer
from extproc.core.release.pool import Pool
from extproc.core.release.pool_report import PoolReport
from extproc.core.strategy import LocalRelease, ReleaseStrategy
from extproc.core.timers import Timers
from extproc.core.values.engine_load import EngineLimits, EngineLoad
from extproc.core.values.outcomes import Refused, shutting_down
from extproc.core.values.report import DispatchReport, PoolEvent, RequestEvent, Step
from extproc.core.values.status import ModelStatus

__all__ = ["Held", "LiveSettings", "ModelDispatcher"]

# Builds a model's release strategy on its state, which it reads as an Outlet (strategy.py) or a
# cluster seat's ClusterOutlet (default: LocalRelease, this instance alone).
StrategyFactory = Callable[[ModelState], ReleaseStrategy]


class ModelDispatcher:
    """One model's held requests: where the servicer submits them and ends them, and every event about its pool arrives.

    It exists so that the servicer and the scrapers talk to one object per
    model whatever decides the releases; each event goes to the part that
    owns what it changes (see the module docstring).
    """

    def __init__(
        self,
        name: str,
        pool: Pool,
        bands: tuple[Band, ...],
        report: DispatchReport,
        clock: Callable[[], float] = time.monotonic,
        *,
        policy: Policy,
        timers: Timers,
        tenant: Callable[[str], Tenant],
        cost: CostWeights,
        max_queued: int,
        max_queue_wait_s: float,
        reserved_waiting: int,
        max_preemptions_per_s: float = 0.0,
        engine_priority: bool | None = False,
        cold_start_wait_s: float = 0.0,
        strategy: StrategyFactory | None = None,
    ) -> None:
        self.name = name
        self._pool = pool
        self._report = report
        self._clock = clock
        # The engines' events, reported as the pool then stands (release/pool_report.py).
        self._pool_report = PoolReport(name, pool, report)
        settings = LiveSettings(bands, tenant, cost, max_queued, max_queue_wait_s, reserved_waiting,
                                pool.rule_type, pool.settings, engine_priority, cold_start_wait_s)
        self._state = ModelState(name, pool, settings, report, clock, timers, policy, max_preemptions_per_s)
        self._strategy = (strategy or (lambda outlet: LocalRelease(outlet, timers)))(self._state)
        self._band_names = tuple(band.name for band in bands)  # kept through reconfigure (same names, same order)
        self._probe: Callable[[tuple[str, ...]], None] | None = None

    def probe_with(self, probe: Callable[[tuple[str, ...]], None]) -> None:
        """Ask ``probe`` to look at endpoints after a request to them ended; their slots wait for its answer.

        The adapter that can reach the engines (``adapters/engines/probe.py``) calls it, and answers through
        :meth:`record_probe` (``core/release/unconfirmed.py`` says why).
        """
        self._probe = probe
        self._pool.probe_ends = True

    def reconfigure(self, settings: LiveSettings) -> None:
        """Take new settings for what comes next; every held request keeps its place, band and deadline.

        The bands must keep their names and order (a queued request's band is
        its index). A changed release rule or rule setting starts the rule
        afresh (an adaptive limit is learned again within a few scrapes) on
        the same load estimate and endpoint health: what is in flight stays
        counted. A request already queued keeps the wait limit it was queued
        with. Dispatches at once: a raised limit releases now.
        """
        self._state.reconfigure(settings)
        self.dispatch()

    @property
    def priority_first(self) -> str | None:
        """Which ``priority`` values the engines run first ("lower", "higher") where the adapter writes the band's
        ``engine_priority`` into each body (negated for "higher"); None: none is written (``model_state.py``)."""
        return self._state.engine_order

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The pool's members now (empty until discovery found one)."""
        return self._pool.endpoints

    def serves(self, eligible: frozenset[str] | None = None) -> bool:
        """Whether an endpoint (of ``eligible``, when given) is there and not down to take a request."""
        return self._pool.serves(eligible)

    def awaits_life(self, endpoint: str) -> bool:
        """Whether ends at ``endpoint`` wait for a sign of life from it (a probe's answer, :meth:`record_probe`)."""
        return self._pool.awaits_life(endpoint)

    @property
    def queued(self) -> int:
        return self._state.queued

    def queued_in(self, band: int) -> int:
        """Requests held in ``band`` (the servicer sheds the lowest class present first)."""
        return self._state.queued_in(band)

    def queued_by_tenant(self) -> dict[tuple[str, str], int]:
        """How many requests each (band name, tenant) has queued now (telemetry recounts its gauges from it)."""
        return self._state.queued_by_tenant()

    @property
    def in_flight(self) -> int:
        """Released requests whose streams have not ended."""
        return self._pool.in_flight

    def status(self, top: int) -> ModelStatus:
        """A read-only snapshot for the status page (``core/values/status.py``); ``top`` tenants listed per band."""
        return self._state.status(top, self._strategy.cluster())

    def demand(self) -> Demand:
        """What the held and in-flight requests ask of the engines now: the series an autoscaler reads (``demand.py``)."""
        return self._state.demand()

    def expect(self, tenant: str, content_length: int | None, max_tokens: float | None) -> tuple[float, float]:
        """The prompt and output tokens a request of ``tenant`` is expected to use: what its release would be charged."""
        return self._state.expect(tenant, content_length, max_tokens)

    def submit(
        self,
        tenant: str,
        band: int,
        *,
        content_length: int | None = None,
        max_tokens: float | None = None,
        affinity: str = "",
        prefix: Prefix = NO_PREFIX,
        eligible: frozenset[str] | None = None,
        ttft_objective_s: float | None = None,
        retried: bool = False,
        whole: bool = False,
        tag: str = "",
    ) -> Held:
        """Queue a request and dispatch; the returned future may already be resolved.

        ``affinity`` groups requests that share a prompt prefix (endpoint picking keeps them on one engine); empty
        means the tenant. ``prefix`` is its prompt's signature (``core/prefix.py``). ``eligible`` limits where it may
        go (endpoint picking). ``ttft_objective_s`` is the client's own objective (the band decides how far to trust
        it); ``retried``: the client says it is a retry, so it is never preempted. ``whole``: its answer is not
        streamed, so it can be taken back until it completes. ``tag``: what its reports name it by (``Request.tag``).
        Raises :class:`~extproc.core.values.outcomes.Refused` when a queue cap leaves no room.
        """
        now, request = self._clock(), Request(tenant, band, affinity or tenant, prefix, eligible, retried, whole, tag)
        try:
            held, first = self._state.enqueue(request, now, content_length, max_tokens, ttft_objective_s)
        except Refused:
            self._report(PoolEvent(decision_s=self._clock() - now))
            raise
        clamped = held.estimate.clamped
        self._strategy.queued(band, tenant, first, now)
        self._preempt_at_risk(now)
        self._report(RequestEvent(Step.QUEUED, self._band_names[band], tenant, tag=tag,
                                  decision_s=self._clock() - now, cost_clamped=clamped))
        return held

    def end(self, held: Held) -> None:
        """The request's stream is over, whatever happened; safe to call more than once.

        Queued: its client left, forget it now. Released: its response has
        finished (or failed, or its client left), which frees an engine slot.
        Refused: nothing left to do.
        """
        if held.ended:
            return
        if not held.released:
            self._state.abandon(held)
            return
        now = self._clock()
        probe = self._state.ended(held, now)
        self._finish(held, now)
        if probe and self._probe is not None:
            self._probe(probe)
        self._preempt_at_risk(self._clock())

    def _finish(self, held: Held, now: float) -> None:
        """A released request is over (it ended, or was preempted): charged, and its strategy told."""
        measured = self._state.finish(held, now)
        request = held.request
        self._strategy.ended(request.band, request.tenant, held.estimate.cost, measured, self._clock())

    def _preempt_at_risk(self, now: float) -> None:
        """End the preemptible requests a higher band's objective at risk needs the slots of (preemption.py)."""
        for victim in self._state.victims(now):
            self._state.preempt(victim, now)
            self._finish(victim, now)

    def record_response(self, held: Held, answer: Answer) -> None:
        """A released request's response began: what the engine answered (:class:`Answer`).

        ``DOWN`` (the engine unreachable, reset before answering) marks its endpoint down before the stream ends, so
        the slot it frees is not handed to the next held request: they wait for the engine, or go to an endpoint that
        is up. ``FULL`` (the engine refused it, its own queue cap reached) cuts the endpoint's limit and leaves it up,
        and the request was not served (a budget charges it nothing). A stream refused inside its 200 is told twice:
        served at its headers, full at its first event.
        """
        if self._state.started(held):
            held.refused = answer is Answer.FULL
            self._release_outcome(held.endpoint, answer)

    def record_served(self, held: Held, endpoint: str) -> None:
        """The gateway reports where ``held`` was served; another endpoint than the pick means the pick failed it."""
        picked = self._state.moved(held, endpoint)
        if picked is not None:
            self._release_outcome(picked, Answer.DOWN)

    def _release_outcome(self, endpoint: str | None, answer: Answer) -> None:
        """How a release to ``endpoint`` went; a change in who is down dispatches."""
        if self._pool_report.response(endpoint, answer, self._clock()):
            self.dispatch()  # reports the change; an endpoint back up takes held requests at once

    def record_probe(self, endpoint: str, alive: bool, started_at: float) -> None:
        """A probe of ``endpoint`` (started at ``started_at``): its engine answered, or nothing listens (down)."""
        if self._pool_report.probe(endpoint, alive, started_at):
            self.dispatch()  # slots confirmed free, or who is down changed (dispatch reports it)

    def record_scrape(self, endpoint: str, load: EngineLoad | None, started_at: float, *, reachable: bool = True) -> None:
        """A scrape's outcome (``load`` None: failed; ``reachable=False``: its connection was refused)."""
        self._pool_report.scrape(endpoint, load, started_at, reachable)
        if load is not None:
            self._state.scraped(endpoint, load, started_at)
        self._strategy.scraped(self._clock())
        self._preempt_at_risk(self._clock())

    def caps_held(self) -> bool:
        """Whether an engine of the pool says it caps what it holds, so it may refuse what the gateway released."""
        return self._pool.caps_held()

    def record_limits(self, endpoint: str, limits: EngineLimits) -> None:
        """What the engine at ``endpoint`` says of its own limits: they bound the rule and the cost's context."""
        if self._pool_report.limits(endpoint, limits):
            self._state.engine_said(limits.max_model_len)
            self.dispatch()

    def set_endpoints(self, endpoints: tuple[str, ...]) -> None:
        """The pool's membership changed (DNS); forget the telemetry of endpoints that left."""
        self._state.left(self._pool_report.members(endpoints))

    def reject_all(self, refused: Callable[[], Refused] = shutting_down) -> None:
        """Refuse every queued request with ``refused()`` (default ``shutting_down``: draining ran out of time)."""
        self._state.reject_all(refused)

    def dispatch(self) -> None:
        """Let go what may go now (the strategy decides), and preempt for an objective at risk."""
        self._strategy.changed(self._clock())
        self._preempt_at_risk(self._clock())
