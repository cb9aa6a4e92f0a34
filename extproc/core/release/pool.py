"""One model pool as the release side sees it: the shared pieces under its release rule, fed in one place.

A pool (one or more engine endpoints serving a model) has one load estimate
(``estimate.py``), one record of endpoint health (``health.py``) and one
release rule (``rule.py``, chosen by the config's ``gate:``). Every event —
a release, a finish, a scrape, a change of members — reaches each piece that
needs it here, in one order, so no rule can miss one. The dispatcher asks the
pool how many may go (through the band rules, ``core/bands.py``) and where
each goes (``picking.py``).

The pool hands out none of its pieces: whoever holds it (the model's state,
the band rules, the demand gauge, the health log, the pool's reports) asks it
a question and the pool answers from whichever piece knows, so a piece can
change without its readers following it.

A *down* endpoint (``health.py``: its engine cannot be reached) gets
nothing: with endpoint picking it has no room; without, the rule counts only
the endpoints that are up, and with every endpoint down the pool releases
nothing at all, so held requests wait for the engine to come back.

A slot freed by an ended request stays taken until the engine has shown
life after the end (``unconfirmed.py``): an engine that dies cuts every
request it serves at once, and their slots must not be refilled into it.
Only where the adapter probes (``probe_ends``); otherwise ends free their
slots at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

from extproc.core.release import picking
from extproc.core.release.answer import Answer
from extproc.core.release.estimate import LoadEstimate, LoadNow
from extproc.core.release.health import EndpointHealth
from extproc.core.release.rule import ReleaseRule, RuleSettings, RuleSnapshot
from extproc.core.release.unconfirmed import UnconfirmedEnds
from extproc.core.values.engine_load import EngineLimits, EngineLoad
from extproc.core.values.status import EndpointStatus


class Pool:
    """The release side of one model pool. Pure: the caller passes ``now`` to every method."""

    def __init__(
        self,
        endpoints: Sequence[str],
        rule: type[ReleaseRule],
        settings: RuleSettings,
        *,
        stale_after_s: float,
        fallback_max_in_flight: int,
        pick_endpoints: bool = False,
    ) -> None:
        if pick_endpoints and not rule.per_endpoint:
            raise ValueError(f"{rule.name} does not pick endpoints (it has no per-endpoint state)")
        self.settings = settings
        self.pick_endpoints = pick_endpoints
        self._estimate = LoadEstimate(endpoints, stale_after_s=stale_after_s, per_endpoint=pick_endpoints)
        self._health = EndpointHealth(endpoints, stale_after_s=stale_after_s, fallback_max_in_flight=fallback_max_in_flight)
        self._rule = rule(settings, self._estimate, self._health)
        # Moves on every event that may change endpoint health or replaces the rule (a scrape, a response, a probe,
        # new members, a reconfigure): while it stands, and until stable_until(), what degraded() and down() answer
        # stands too. A plain value, so the health log's look before each dispatch (health_log.py) costs no call.
        self.health_version = 0
        self._unconfirmed = UnconfirmedEnds(endpoints, per_endpoint=pick_endpoints)
        # Per endpoint, what is wrong with the engine's own settings (EngineLimits.too_tight).
        self._warnings: dict[str, str] = {}
        # Per endpoint, the engine's rejection counter at its last usable scrape.
        self._rejected: dict[str, float] = {}
        # Per endpoint, whether its engine said it orders its queue by priority, and which values first.
        self._priority_first: dict[str, str | None] = {}
        # The endpoints whose engine says it caps what it holds (EngineLimits.max_held): it may refuse a release.
        self._capped: set[str] = set()
        # Set by the adapter that probes the endpoints (``probe_ends``): ends then wait for a sign of life.
        self.probe_ends = False

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self._estimate.endpoints

    @property
    def rule_type(self) -> type[ReleaseRule]:
        """The release rule the pool runs (the config's ``gate:``), as :meth:`reconfigure` takes it."""
        return type(self._rule)

    @property
    def uses_metrics(self) -> bool:
        """Whether the rule reads the engines' metrics (else it counts, or paces, alone)."""
        return self._rule.uses_metrics

    @property
    def seen_waiting(self) -> bool:
        """Whether any engine of the pool has been seen queueing since it started (``estimate.py``)."""
        return self._estimate.seen_waiting

    def in_flight_on(self, endpoint: str) -> int:
        """Ours in flight at ``endpoint`` (with endpoint picking)."""
        return self._estimate.in_flight_on(endpoint)

    def scraped_load(self) -> EngineLoad | None:
        """What the last usable pages said, summed over the pool; None before every endpoint has one."""
        return self._estimate.pool_load()

    def last_good(self, endpoint: str) -> EngineLoad | None:
        """What ``endpoint``'s last usable page said; None: it has had none."""
        return self._health.last_good(endpoint)

    def fallback_limit(self, endpoint: str) -> int:
        """What ``endpoint`` may hold while its metrics are unusable (``health.py``)."""
        return self._health.fallback_limit(endpoint)

    def ready(self, now: float) -> list[str]:
        """The members whose metrics are usable now (up, scraped, fresh)."""
        return [e for e in self.endpoints if self._health.healthy(e, now)]

    def unusable_metrics(self, now: float) -> tuple[str, ...]:
        """The members whose metrics cannot be used now (down ones included), whether or not the rule reads them."""
        return self._health.degraded(now)

    def unconfirmed(self, endpoint: str | None = None) -> int:
        """Slots freed by ended requests (at ``endpoint``, or anywhere) still held until the engine shows life."""
        return self._unconfirmed.count(endpoint)

    def caps_held(self) -> bool:
        """Whether an engine of the pool says it caps what it holds (it may refuse a release)."""
        return bool(self._capped)

    def stable_until(self, now: float) -> float:
        """Until when, with no event, what :meth:`degraded` answers stays as it is now (a page goes stale)."""
        return self._health.stable_until(now) if self._rule.uses_metrics else math.inf

    @property
    def in_flight(self) -> int:
        return self._estimate.in_flight

    @property
    def cluster_in_flight(self) -> int:
        """Ours in flight and the other instances' (a cluster's); ours alone without one."""
        return self._estimate.cluster_in_flight

    def record_others(self, now: float, others: int) -> None:
        """The other instances of a cluster have ``others`` in flight now (``estimate.py``)."""
        self._estimate.record_others(now, others)

    def load_now(self) -> LoadNow:
        """What the engines hold now by the load estimate."""
        return self._estimate.now()

    def engine_full(self, load: LoadNow) -> bool:
        """Whether the engine has no free slot, by ``load``: it queues, or holds its capacity (when that is known)."""
        if load.waiting > 0:
            return True
        capacity = self.capacity()
        return capacity > 0 and load.held >= capacity

    def next_change_in(self, now: float) -> float | None:
        """How long until the rule lets more go by time alone (a rate); None: only an event will."""
        return self._rule.next_change_in(now)

    def snapshot(self, endpoint: str) -> RuleSnapshot:
        """What the rule holds of ``endpoint`` now (its limit, its inter-token latency)."""
        return self._rule.snapshot(endpoint)

    def capacity(self) -> float:
        """How many requests the engines run at once: ``max_running`` per endpoint when configured, else the most seen."""
        if self.settings.max_running is not None:
            return self.settings.max_running * len(self.endpoints)
        return self._estimate.peak_running

    def free_slots(self, now: float) -> int:
        """Slots the engines have free now by the load estimate: their capacity less what they hold, none while they queue.

        0 where free slots cannot be seen: a rule that reads no metrics,
        endpoints whose metrics cannot be trusted, a capacity not known yet.
        Work conservation is stated in these slots (``core/bands.py``): while
        one is free, nothing keeps a held request from it.
        """
        if not self._rule.uses_metrics or not self._health.up or self._health.degraded(now):
            return 0
        estimate = self._estimate.now()
        if estimate.waiting > 0:
            return 0
        return max(0, math.floor(self.capacity() - estimate.held))

    def room(self, now: float) -> tuple[int, int]:
        """:meth:`headroom` and :meth:`free_slots` in one question: every release round asks both (``bands.py``)."""
        return self.headroom(now), self.free_slots(now)

    def reconfigure(self, rule: type[ReleaseRule], settings: RuleSettings) -> None:
        """A new rule, or new settings for it: started afresh on the same load estimate and endpoint health.

        What is in flight stays counted (the estimate holds it); what the old
        rule had learned (an adaptive limit) is learned again from the next scrapes.
        """
        if self.pick_endpoints and not rule.per_endpoint:
            raise ValueError(f"{rule.name} does not pick endpoints (it has no per-endpoint state)")
        self.settings = settings
        self._rule = rule(settings, self._estimate, self._health)
        self.health_version += 1

    def set_endpoints(self, endpoints: Sequence[str]) -> None:
        """The pool's members changed (DNS); new ones start degraded until scraped."""
        self.health_version += 1
        self._estimate.set_endpoints(endpoints)
        self._health.set_endpoints(endpoints)
        self._rule.set_endpoints(self.endpoints)
        self._unconfirmed.set_endpoints(self.endpoints)
        self._warnings = {e: w for e, w in self._warnings.items() if e in self.endpoints}
        self._rejected = {e: n for e, n in self._rejected.items() if e in self.endpoints}
        self._priority_first = {e: p for e, p in self._priority_first.items() if e in self.endpoints}
        self._capped &= set(self.endpoints)

    def record_release(
        self, request: Hashable, now: float, endpoint: str | None = None, *, into_free_slot: bool = False
    ) -> None:
        self._estimate.record_release(request, now, endpoint, into_free_slot)
        self._health.record_release(endpoint, now)
        self._rule.record_release(now)

    def released(self, request: Hashable, now: float, endpoint: str | None, *, into_free_slot: bool,
                 full_before: bool) -> tuple[bool, bool]:
        """A release, recorded (:meth:`record_release`): whether to read its response headers for a failure
        (:meth:`check_release`), and (asked with ``full_before``) whether the engines had no free slot before it
        (:meth:`engine_full`). One question where every release asked three or four."""
        checked = self._health.released(endpoint, now)
        before = self._estimate.record_release(request, now, endpoint, into_free_slot, before=full_before)
        self._rule.record_release(now)
        return checked, before is not None and self.engine_full(before)

    def check_release(self, endpoint: str | None, now: float) -> bool:
        """Whether the response headers of this release should be read for a failure (``health.py``)."""
        return self._health.check_release(endpoint, now)

    def record_finish(self, request: Hashable, now: float) -> float:
        """Note a finished request; returns how long it was released (its occupancy)."""
        occupancy = self._estimate.record_finish(request, now)
        self._rule.record_finish(now)
        return occupancy

    def record_limits(self, endpoint: str, limits: EngineLimits) -> str | None:
        """What the engine at ``endpoint`` says of its own limits: they bound the rule. The warning (a cap too tight, or
        ""); None: not a member."""
        if endpoint not in self.endpoints:
            return None
        if limits.max_held is None:
            self._capped.discard(endpoint)
        else:
            self._capped.add(endpoint)
        self._rule.record_limits(endpoint, limits)
        self._priority_first[endpoint] = limits.priority_first
        warning = self._warnings[endpoint] = limits.too_tight(self._rule.settings.target_waiting, self._rule.runs(endpoint))
        return warning

    def priority_first(self) -> str | None:
        """Which request priorities every member's engine runs first ("lower" or "higher"), where all of them said
        they order their queue by priority and agree; None otherwise (one that does not, or has not said yet)."""
        said = {self._priority_first.get(e) for e in self.endpoints}
        return said.pop() if len(said) == 1 else None

    def awaits_life(self, endpoint: str) -> bool:
        """Whether ends at ``endpoint`` wait for a sign of life from it, so a probe of it is worth sending."""
        return endpoint in self.endpoints and self._unconfirmed.waits_on(endpoint)

    def record_end(self, endpoint: str | None, now: float) -> tuple[str, ...]:
        """A released request's stream ended (not preempted): its slot waits for a sign of life; the endpoints to probe."""
        if not self.probe_ends:
            return ()
        return self._unconfirmed.ended(endpoint, now)

    def record_alive(self, endpoint: str, started_at: float) -> bool:
        """``endpoint`` showed life (a probe or scrape that started at ``started_at``); True if slots came free."""
        return self._unconfirmed.alive(endpoint, started_at, self._health.serving())

    def record_probe(self, endpoint: str, alive: bool, started_at: float) -> bool:
        """A probe of ``endpoint`` that started at ``started_at``: its engine answered (``alive``), or nothing listens.

        Alive, it is up (if it was down) and the ends before the probe are
        confirmed; otherwise it is down. True if slots came free.
        """
        self.health_version += 1
        if not alive:
            self._health.mark_down(endpoint, started_at)
            self._forget_down()
            return False
        self._health.record_response(endpoint, True, started_at)
        return self.record_alive(endpoint, started_at)

    def _forget_down(self) -> None:
        """What an endpoint that is down held is gone: its unconfirmed ends hold nothing any more."""
        up = self._health.serving()
        for endpoint in self._health.down():
            self._unconfirmed.gone(endpoint, up)

    def record_scrape(self, endpoint: str, load: EngineLoad | None, started_at: float, *, reachable: bool = True) -> float:
        """A scrape of ``endpoint`` that started at ``started_at`` returned ``load`` (None: failed).

        ``reachable=False``: its connection was refused (the engine is down).
        Returns how many requests the engine says it refused at its own queue
        cap since its last usable page; any tells the rule (rule 5 of the
        adaptive limit).
        """
        self.health_version += 1
        usable = self._health.record_scrape(endpoint, load, started_at, reachable=reachable)
        if not reachable:
            self._forget_down()
        elif load is not None:  # a page, frozen or not: the engine lives
            self.record_alive(endpoint, started_at)
        if not usable:
            return 0.0  # failed, frozen, or of an endpoint that left: nothing to learn from it
        assert load is not None
        held_then = self._estimate.record_scrape(endpoint, load, started_at)
        refused = self._refusals(endpoint, load.rejected)
        if refused:
            self._rule.record_refusal(endpoint, started_at, load.running + load.waiting if held_then is None else held_then)
        self._rule.record_scrape(endpoint, load, started_at, held_then)
        return refused

    def _refusals(self, endpoint: str, rejected: float | None) -> float:
        """How many requests the engine's counter says it refused since its last page (a drop is a restart)."""
        if rejected is None:
            return 0.0
        before = self._rejected.get(endpoint)
        self._rejected[endpoint] = rejected
        return rejected - before if before is not None and rejected > before else 0.0

    def record_response(self, endpoint: str | None, answer: Answer, now: float) -> str | None:
        """A released request's response began: what the engine answered (answer.py).

        ``endpoint`` is where it was picked; without picking only a pool of one
        tells where it went. Returns the endpoint the outcome was recorded for.
        """
        self.health_version += 1
        target = endpoint if endpoint is not None else self.endpoints[0] if len(self.endpoints) == 1 else None
        if target is not None:
            alive = answer is not Answer.DOWN
            self._health.record_response(target, alive, now)
            if alive:
                self.record_alive(target, now)
            else:
                self._forget_down()
            if answer is Answer.FULL:  # what it holds: ours counted where they can be told apart (a pool of one)
                self._rule.record_refusal(target, now, self._estimate.now(target if self.pick_endpoints else None).held)
        return target

    def allowance(self, now: float) -> int:
        """How many requests may be released now, never negative (with picking: what the endpoints may take)."""
        return max(0, self.headroom(now))

    def headroom(self, now: float) -> int:
        """The allowance before it is floored at 0: negative when more are out than allowed."""
        if not self._health.up:
            return 0  # every engine down: hold everything until one returns
        if self.pick_endpoints:
            return sum(self.endpoint_room(e, now) for e in self.endpoints)
        return self._rule.allowance(now) - self._unconfirmed.count()

    def endpoint_room(self, endpoint: str, now: float) -> int:
        """Requests ``endpoint`` may get now (with endpoint picking): none while down, less its unconfirmed ends."""
        if self._health.is_down(endpoint):
            return 0
        return max(0, self._rule.endpoint_allowance(endpoint, now) - self._unconfirmed.count(endpoint))

    def degraded(self, now: float) -> tuple[str, ...]:
        """Endpoints whose metrics are unusable now (down ones included), where the rule reads metrics at all."""
        return self._health.degraded(now) if self._rule.uses_metrics else ()

    def down(self) -> list[str]:
        """Endpoints whose engine cannot be reached: nothing goes to them, whatever the rule."""
        return self._health.down()

    def ranked(self, key: str, now: float, eligible: frozenset[str] | None = None,
               hit: Callable[[str], float] | None = None) -> list[str]:
        """Where the next release with affinity ``key`` goes, best first (empty: without picking).

        Only endpoints up, and in ``eligible`` when given (a gateway's subset
        hint); if every one of those is down, all of them, so a release still
        names somewhere to try. ``hit``: the prompt tokens it would find cached
        at each (``picking.py`` weighs them against load).
        """
        if not self.pick_endpoints:
            return []
        candidates = [e for e in self.endpoints if eligible is None or e in eligible]
        up = [e for e in candidates if not self._health.is_down(e)]
        return picking.ranked(key, up or candidates, lambda e: self.endpoint_room(e, now), self.settings.target_waiting, hit)

    def serving(self, eligible: frozenset[str] | None = None) -> list[str]:
        """The members (of ``eligible``, when given) that are not down."""
        return [e for e in self.endpoints if not self._health.is_down(e) and (eligible is None or e in eligible)]

    def serves(self, eligible: frozenset[str] | None = None) -> bool:
        """Whether any endpoint (of ``eligible``, when given) is a member that is not down."""
        return any(not self._health.is_down(e) for e in self.endpoints if eligible is None or e in eligible)

    def record_moved(self, request: Hashable, endpoint: str) -> None:
        """``request`` runs on ``endpoint`` after all (the gateway fell back to it): count it there."""
        self._estimate.record_moved(request, endpoint)

    def endpoint_statuses(self, now: float) -> tuple[EndpointStatus, ...]:
        """Each member as the status page shows it (``core/values/status.py``)."""
        degraded, down = set(self.degraded(now)), set(self.down())
        statuses = []
        for url in self.endpoints:
            load = self._health.last_good(url)
            good_at = self._health.good_at(url)
            statuses.append(EndpointStatus(
                url=url,
                running=load.running if load is not None else None,
                waiting=load.waiting if load is not None else None,
                scraped_ago_s=now - good_at if load is not None else None,
                limit=self._rule.snapshot(url).limit,
                degraded=url in degraded,
                down=url in down,
                in_flight=self._estimate.in_flight_on(url),
                warning=self._warnings.get(url, ""),
            ))
        return tuple(statuses)
