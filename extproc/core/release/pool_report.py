"""What the engines' events did to a model's pool, told as the core's endpoint events.

The dispatcher routes every engine event to the pool: a released request's
outcome, a probe's answer, a scrape, what an engine says of its own limits,
a change of members. What the pool then holds (who is down, an endpoint's
limit and latency) is the pool's, so it is read and reported here, beside
it, through the model's :class:`~extproc.core.values.report.DispatchReport`; the
dispatcher only learns whether the event calls for a dispatch.
"""

from __future__ import annotations

from extproc.core.release.answer import Answer
from extproc.core.release.pool import Pool
from extproc.core.values.engine_load import EngineLimits, EngineLoad
from extproc.core.values.report import Change, DispatchReport, EndpointEvent


class PoolReport:
    """One model's pool fed its engines' events, each reported as the pool then stands."""

    __slots__ = ("_model", "_pool", "_report")

    def __init__(self, model: str, pool: Pool, report: DispatchReport) -> None:
        self._model = model
        self._pool = pool
        self._report = report

    def response(self, endpoint: str | None, answer: Answer, now: float) -> bool:
        """A release to ``endpoint`` got ``answer`` (a failed or a full one is reported); whether who is down changed."""
        pool = self._pool
        down = pool.down()
        target = pool.record_response(endpoint, answer, now)
        if answer is Answer.DOWN:
            self._report(EndpointEvent(target, Change.RELEASE_FAILED))
        elif answer is Answer.FULL:
            limit = pool.snapshot(target).limit if target is not None else None
            self._report(EndpointEvent(target, Change.REFUSED_FULL, limit=limit))
        return pool.down() != down

    def probe(self, endpoint: str, alive: bool, started_at: float) -> bool:
        """A probe of ``endpoint`` answered; whether slots were confirmed free or who is down changed."""
        pool = self._pool
        down = pool.down()
        return pool.record_probe(endpoint, alive, started_at) or pool.down() != down

    def scrape(self, endpoint: str, load: EngineLoad | None, started_at: float, reachable: bool) -> None:
        """A scrape's outcome, reported with the endpoint's latency and limit after it (``load`` None: it failed)."""
        refused = self._pool.record_scrape(endpoint, load, started_at, reachable=reachable)
        if load is None:
            self._report(EndpointEvent(endpoint, Change.SCRAPE_FAILED))
            return
        snapshot = self._pool.snapshot(endpoint)
        self._report(EndpointEvent(endpoint, Change.SCRAPED, load, snapshot.itl_s, snapshot.limit, refused=refused))

    def limits(self, endpoint: str, limits: EngineLimits) -> bool:
        """What the engine at ``endpoint`` says of its limits, told (with a cap too tight, warned); whether it was new."""
        warning = self._pool.record_limits(endpoint, limits)
        if warning is None:
            return False
        said = ", ".join(f"{k} {v}" for k, v in vars(limits).items() if v is not None) or "nothing of its limits"
        note = f"model {self._model}: engine {endpoint} says {said}" + (f"; {warning}" if warning else "")
        self._report(EndpointEvent(endpoint, Change.LIMITS, note=note, warning=bool(warning)))
        return True

    def members(self, endpoints: tuple[str, ...]) -> set[str]:
        """The pool's members are now ``endpoints``; those that left are reported (their series go) and returned."""
        gone = set(self._pool.endpoints) - set(endpoints)
        for endpoint in gone:
            self._report(EndpointEvent(endpoint, Change.LEFT))
        self._pool.set_endpoints(endpoints)
        return gone
