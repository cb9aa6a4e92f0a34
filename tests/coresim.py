"""One model's dispatcher in front of the simulator's engine, in simulated time: no sockets, no clock, no sleeps.

The scheduling core (``ModelDispatcher`` with the adaptive gate) and the
simulator's pure continuous-batching ``Scheduler`` run on one heap of timed
events (``extproc/tools/simclock.py``), so a minute of traffic takes milliseconds and every run is exactly
repeatable. What connects them is what Envoy and vLLM's API server do:

* a released request reaches the engine ``lag_s`` later, and only at the start
  of a step (vLLM takes new requests between steps);
* the engine's ``/metrics`` are scraped every ``scrape_s`` and show its last
  step's stats (``Scheduler.shown_running``, ``shown_waiting``);
* a finished request's stream ends ``end_lag_s`` after its last token;
  its first token tells the dispatcher its response began (a non-streamed
  answer's last token: its headers come with the whole answer);
* a preempted request is aborted in the engine at once (Envoy resets it).

``check`` runs after every moment something happened, once its events are
all done: the tests' invariants are asserted there, at every such moment, not
at chosen ones. Events at one instant are one moment (a release that wakes
the dispatcher again at once, as the event loop's next callback, is one).
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from extproc.core.bands import Band
from extproc.core.cost import CostWeights
from extproc.core.dispatcher import Held, ModelDispatcher
from extproc.core.entitlement import Tenant
from extproc.core.model_state import ModelState
from extproc.core.policies import POLICIES
from extproc.core.release import RULES, RuleSettings
from extproc.core.release.answer import Answer
from extproc.core.release.pool import Pool
from extproc.core.strategy import Limit, LocalRelease
from extproc.core.values.engine_load import EngineLoad
from extproc.core.values.outcomes import Refused
from extproc.core.values.report import Event
from extproc.tools.sim.engine import Scheduler, SimRequest, SimSettings
from extproc.tools.sim.kvcache import block_hashes
from extproc.tools.simclock import EventHeap

ENDPOINT = "http://engine"
BANDS = (Band("interactive", ttft_objective_s=5.0), Band("standard", ttft_objective_s=60.0),
         Band("batch", idle_only=True, preemptible=True, min_share=0.0))


@dataclass(frozen=True)
class Arrival:
    at: float
    band: int
    tenant: str
    prompt_tokens: int
    max_tokens: int
    # A non-streamed answer begins (its headers come) only when it is whole: preemptible until then.
    stream: bool = True
    # The client says it is a retry (a preempted request sent again): never preempted.
    retried: bool = False
    # The prompt's tokens (any hashable units), hashed for an engine with prefix caching; none: nothing hits.
    units: tuple[Hashable, ...] = ()


def chat_arrivals(start: float, until: float, poisson: bool, seed: int) -> list[Arrival]:
    """alice's chats (10 prompt tokens, 16 out) from ``start`` to ``until``: 4 a second, Poisson or every 250 ms."""
    rng, arrivals, at = random.Random(seed), [], start
    while at < until:
        arrivals.append(Arrival(at, 0, "alice", 10, 16))
        at += rng.expovariate(4.0) if poisson else 0.25
    return arrivals


@dataclass
class Request:
    """One arrival's life: its queue entry, its engine request, and when each thing happened."""

    arrival: Arrival
    held: Held
    sim: SimRequest | None = None
    released_at: float | None = None
    first_token_at: float | None = None
    ended_at: float | None = None
    outcome: str = "queued"  # released, done, refused, preempted


class CoreSim(EventHeap):
    """The dispatcher and the simulated engine on one event heap (see the module docstring); its timers are the
    dispatcher's."""

    def __init__(
        self,
        engine: SimSettings,
        *,
        bands: tuple[Band, ...] = BANDS,
        target_waiting: int = 3,
        reserved_waiting: int = 0,
        max_running: int | None = None,
        max_preemptions_per_s: float = 0.0,
        scrape_s: float = 0.1,
        lag_s: float = 0.06,
        end_lag_s: float = 0.002,
        max_queue_wait_s: float = 3600.0,
        engine_priority: bool = False,
        stream_begins_at_accept: bool = False,
        policy: str = "round_robin",
        check: Callable[[CoreSim], None] | None = None,
        ended: Callable[[CoreSim, Request], None] | None = None,
    ) -> None:
        super().__init__()
        self.bands = bands
        self.scrape_s = scrape_s
        self.lag_s = lag_s
        self.end_lag_s = end_lag_s
        # The band's index as the request's priority in the engine's queue (an engine with a priority queue).
        self.engine_priority = engine_priority
        # A stream's response begins as the engine accepts it (vLLM sends its headers then), not at its first token.
        self.stream_begins_at_accept = stream_begins_at_accept
        self._check = check
        # Told of each released request that ended (done or preempted): a client that sends more (``add``).
        self._ended = ended
        self.scheduler = Scheduler(engine)
        self.step_end: float | None = None
        self._inbox: list[tuple[SimRequest, Request]] = []
        self._by_sim: dict[SimRequest, Request] = {}
        self.requests: list[Request] = []
        self._active: list[Request] = []  # queued or in flight: what _notice looks at
        # Of those, how many were queued and which were released at the last look (_notice skips a look that
        # would find nothing to do: no queued request resolved, none released preempted or ended for ``ended``).
        self._queued_seen = 0
        self._released: list[Request] = []
        self._to_come = 0  # arrivals on the heap
        self.events: list[Event] = []
        self.limits: list[tuple[float, float]] = []  # (scrape time, the adaptive limit after it)
        self.pool = Pool((ENDPOINT,), RULES["adaptive"], RuleSettings(target_waiting, max_running=max_running),
                         stale_after_s=10 * scrape_s, fallback_max_in_flight=4)
        every = Tenant(tuple(b.name for b in bands), bands[0].name, weight=1.0, max_queued=1_000_000)
        # An extra limit on what the strategy lets go (``strategy.Limit``): a test's changed rule, set any time.
        self.limit: Limit | None = None
        self.dispatcher = ModelDispatcher(
            "m", self.pool, bands, lambda event: self.events.append(event), lambda: self.now, policy=POLICIES[policy],
            tenant=lambda _: every, cost=CostWeights(), max_queued=1_000_000, max_queue_wait_s=max_queue_wait_s,
            reserved_waiting=reserved_waiting, max_preemptions_per_s=max_preemptions_per_s, timers=self,
            engine_priority=engine_priority, strategy=self._strategy,
        )
        self.call_at(0.0, self._scrape)

    def _strategy(self, state: ModelState) -> LocalRelease:
        """The dispatcher's own strategy, within :attr:`limit` when one is set; keeps ``state`` (:attr:`state`)."""
        self.state = state
        return LocalRelease(state, self, limit=lambda band, now: self.limit(band, now) if self.limit else sys.maxsize)

    # --- the run ----------------------------------------------------------------------------------------

    def run(self, arrivals: Sequence[Arrival], until: float) -> None:
        """Replay ``arrivals``, then run until ``until`` (simulated seconds)."""
        self.add(arrivals)
        while (due := self.next_at()) is not None and due <= until:
            if (not self._to_come and not self._queued_seen and self.step_end is None and not self._inbox
                    and not any(r.outcome == "released" for r in self._released)):
                return  # everything answered: only scrapes are left
            self.run_next()
            self._notice()
            if self._check is not None and self.next_at() != self.now:  # the moment's last event
                self._check(self)

    def add(self, arrivals: Sequence[Arrival]) -> None:
        """More arrivals, before or during a run (at or after ``now``)."""
        for arrival in arrivals:
            self.call_at(arrival.at, lambda a=arrival: self._arrive(a))  # type: ignore[misc]
        self._to_come += len(arrivals)

    @property
    def held(self) -> int:
        """Requests the gateway holds now."""
        return self.dispatcher.queued

    def _arrive(self, arrival: Arrival) -> None:
        self._to_come -= 1
        try:
            held = self.dispatcher.submit(arrival.tenant, arrival.band, max_tokens=arrival.max_tokens,
                                          content_length=4 * arrival.prompt_tokens, retried=arrival.retried,
                                          whole=not arrival.stream)
        except Refused:
            return
        request = Request(arrival, held)
        self.requests.append(request)
        self._active.append(request)
        self._queued_seen += 1

    def _notice(self) -> None:
        """Releases, refusals and preemptions the last event caused: what the ext_proc streams would do.

        Each look walks every request queued or in flight, in arrival order; most events change none of them, and
        a look then is skipped: every queued request still queued (the dispatcher holds as many), and no released
        one preempted, or ended where ``ended`` wants to hear of it. A request that ended is dropped at the next look.
        """
        if self._queued_seen == self.dispatcher.queued and not self._any_due():
            return
        for request in self._active:
            held = request.held
            if request.outcome == "queued" and held.future.done():
                if held.future.exception() is not None:
                    request.outcome, request.ended_at = "refused", self.now
                    continue
                request.outcome, request.released_at = "released", self.now
                engine = self.scheduler
                hashes = block_hashes(request.arrival.units, engine.block_size) if engine.prefix_caching else ()
                sim = SimRequest(prompt_tokens=request.arrival.prompt_tokens, max_tokens=request.arrival.max_tokens,
                                 arrival=self.now, priority=request.arrival.band if self.engine_priority else 0,
                                 block_hashes=hashes)
                request.sim = sim
                self._by_sim[sim] = request
                self.call_at(self.now + self.lag_s, lambda s=sim, r=request: self._reach(s, r))  # type: ignore[misc]
                if self.stream_begins_at_accept and request.arrival.stream:
                    self.call_at(self.now + self.end_lag_s, lambda r=request: self._accepted(r))  # type: ignore[misc]
            if request.outcome == "released" and held.preempted is not None and held.preempted.done():
                request.outcome, request.ended_at = "preempted", self.now
                if request.sim is not None and not request.sim.finished and request.sim in self._by_sim:
                    if any(s is request.sim for s, _ in self._inbox):
                        self._inbox = [(s, r) for s, r in self._inbox if s is not request.sim]
                    elif request.sim.scheduled_at is not None or request.sim in self.scheduler.waiting:
                        self.scheduler.abort(request.sim)
                self.dispatcher.end(held)
            if request.outcome in ("done", "preempted") and self._ended is not None:
                self._ended(self, request)
        active: list[Request] = []
        released: list[Request] = []
        for request in self._active:  # one pass over what is left: a look walks every request in flight
            if request.outcome == "released":
                released.append(request)
            elif request.outcome != "queued":
                continue
            active.append(request)
        self._active, self._released = active, released
        self._queued_seen = len(active) - len(released)

    def _any_due(self) -> bool:
        """Whether a request released at the last look needs one now: preempted, or ended and ``ended`` is told.

        One loop, no call per request: it runs after every event of every replay.
        """
        told = self._ended is not None
        for request in self._released:
            if request.outcome != "released":
                if told:
                    return True
                continue
            preempted = request.held.preempted
            if preempted is not None and preempted.done():
                return True
        return False

    def _accepted(self, request: Request) -> None:
        if request.outcome == "released":
            self.dispatcher.record_response(request.held, Answer.SERVED)

    def _reach(self, sim: SimRequest, request: Request) -> None:
        if request.outcome != "released":
            return
        self._inbox.append((sim, request))
        if self.step_end is None:
            self._step()

    def _step(self) -> None:
        for sim, _ in self._inbox:
            self.scheduler.add(sim)
        self._inbox.clear()
        if not self.scheduler.has_work:
            self.step_end = None
            return
        step = self.scheduler.schedule(self.now)
        self.step_end = self.now + step.duration
        self.call_at(self.step_end, self._complete)

    def _complete(self) -> None:
        for token in self.scheduler.complete(self.now):
            request = self._by_sim.get(token.request)
            if request is None or request.outcome != "released":
                continue
            if token.index == 0:
                request.first_token_at = self.now
            begins = token.index == 0 and request.arrival.stream and not self.stream_begins_at_accept
            if begins or (token.request.finished and not request.arrival.stream):
                self.dispatcher.record_response(request.held, Answer.SERVED)
            if token.request.finished:
                self.call_at(self.now + self.end_lag_s, lambda r=request: self._end(r))  # type: ignore[misc]
        self.step_end = None
        self._step()

    def _end(self, request: Request) -> None:
        if request.outcome == "released":
            request.outcome, request.ended_at = "done", self.now
        self.dispatcher.end(request.held)

    def _scrape(self) -> None:
        scheduler = self.scheduler
        load = EngineLoad(waiting=scheduler.shown_waiting, running=scheduler.shown_running,
                          kv_usage=scheduler.kv_usage)
        self.dispatcher.record_scrape(ENDPOINT, load, self.now)
        limit = self.pool.snapshot(ENDPOINT).limit
        if limit is not None:
            self.limits.append((self.now, limit))
        self.call_at(self.now + self.scrape_s, self._scrape)

    # --- what the tests read -----------------------------------------------------------------------------

    def free_slots(self) -> int:
        """The engine's free slots by the gate's own measure: capacity less what the estimate holds, none while it queues.

        Written here from the load estimate's public numbers rather than taken
        from ``Pool.free_slots``, so the invariant is checked against the
        estimate, not against the code under test.
        """
        pool = self.pool
        if pool.degraded(self.now):
            return 0
        estimate = pool.load_now()
        if estimate.waiting > 0:
            return 0
        return max(0, math.floor(pool.capacity() - estimate.held))

    def true_free_slots(self) -> int:
        """What the engine really has free now: no queue inside it, fewer running than its batch."""
        scheduler = self.scheduler
        if scheduler.waiting or self._inbox:
            return 0
        return scheduler.max_num_seqs - len(scheduler.running)

    def held_bands(self) -> set[int]:
        """The bands of the requests the gateway holds now."""
        return {r.arrival.band for r in self.queued()}

    def queued(self) -> list[Request]:
        """The requests the gateway holds now."""
        return [r for r in self._active if r.outcome == "queued"]

    def of(self, band: int) -> list[Request]:
        return [r for r in self.requests if r.arrival.band == band]


class DirectSim(EventHeap):
    """The same engine with clients straight to it, no gateway: each arrival reaches it ``lag_s`` later, with its band as
    its priority (an engine with a priority queue orders by it; one in arrival order ignores it). The reference a
    gateway is held against."""

    def __init__(self, engine: SimSettings, *, lag_s: float = 0.06) -> None:
        super().__init__()
        self.lag_s = lag_s
        self.scheduler = Scheduler(engine)
        self._inbox: list[SimRequest] = []
        self._step_end: float | None = None
        self.requests: list[tuple[Arrival, SimRequest]] = []
        # Told of each request that finished: a client that sends more (``add``).
        self.finished: Callable[[DirectSim, Arrival], None] | None = None
        self._arrival: dict[SimRequest, Arrival] = {}

    def add(self, arrivals: Sequence[Arrival]) -> None:
        for arrival in arrivals:
            self.call_at(arrival.at + self.lag_s, lambda a=arrival: self._reach(a))  # type: ignore[misc]

    def run(self, arrivals: Sequence[Arrival], until: float) -> None:
        self.add(arrivals)
        while (due := self.next_at()) is not None and due <= until:
            self.run_next()

    def _reach(self, arrival: Arrival) -> None:
        sim = SimRequest(arrival.prompt_tokens, arrival.max_tokens, self.now, priority=arrival.band)
        self.requests.append((arrival, sim))
        self._arrival[sim] = arrival
        self._inbox.append(sim)
        if self._step_end is None:
            self._step()

    def _step(self) -> None:
        for sim in self._inbox:
            self.scheduler.add(sim)
        self._inbox.clear()
        if not self.scheduler.has_work:
            self._step_end = None
            return
        self._step_end = self.now + self.scheduler.schedule(self.now).duration
        self.call_at(self._step_end, self._complete)

    def _complete(self) -> None:
        for token in self.scheduler.complete(self.now):
            if token.request.finished and self.finished is not None:
                self.finished(self, self._arrival[token.request])
        self._step_end = None
        self._step()

    def of(self, band: int) -> list[tuple[Arrival, SimRequest]]:
        return [(a, r) for a, r in self.requests if a.band == band]

