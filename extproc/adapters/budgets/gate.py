"""Each request's budget check at admission, and its settlement when its stream ends.

To the servicer the gate is one object around the submit: :meth:`BudgetGate.enter`
before the request is queued, :meth:`BudgetGate.leave` at its end, whatever the
end was (the request's pass rides on its stream between the two).

:meth:`BudgetGate.admit` is asked once the tenant, the model and the class are
known, before the request is queued: within its limits the request
goes on with its reservation made (and its rate headers, when the config
wants them on responses); over one, the tenant's action decides (core:
``Verdict``): ``refuse`` raises the 429 (``rate_limit_exceeded`` or
``insufficient_quota``, with ``Retry-After`` when there is room again and the
rate headers), ``downgrade`` moves the request to the lowest class, ``report``
lets it go as it is. Whatever then happens, the servicer hands the pass back
with the request's :class:`~extproc.core.held.Held` (:meth:`BudgetGate.end`):
served, it is charged the usage the engine reported in its response
(``request/engine_usage.py``), or, where none came, what the cost model
measured at its end; not served (refused in the queue, its client gone while
queued, preempted before its response began), nothing.

With ``cluster:`` the counts are the cluster's, in Redis (``cluster_ledger.py``): one
round trip per decision; Redis away, this instance's share of each limit. The
end's correction, sent without waiting, carries the request's charge to the
cluster's usage book (``cluster_usage.py``); the limits as they stand are read
back for the metrics and the status page (``cluster_standings.py``).

Time is the wall clock: budgets are per calendar day and month (UTC).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from redis.exceptions import RedisError

from extproc.adapters.budgets import cluster_usage
from extproc.adapters.budgets.cluster_ledger import ClusterBudgets, ClusterTicket, amounts, meters, share, view
from extproc.adapters.budgets.cluster_standings import ClusterStandings
from extproc.adapters.budgets.headers import NO_RETRY, rate_headers
from extproc.adapters.budgets.plan import plan
from extproc.adapters.config.budgets import BudgetSettings
from extproc.adapters.request.admission import Admission
from extproc.adapters.request.engine_usage import Reported, UsageReader
from extproc.adapters.request.request_fields import RequestFields, max_tokens
from extproc.core.budgets.book import Usage
from extproc.core.budgets.ledger import Budgets, Over, Standing, Ticket, over_reason
from extproc.core.budgets.limits import Action, Kind
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.held import Held
from extproc.core.values.outcomes import Refusal, Refused

log = logging.getLogger(__name__)

REFUSALS = {Over.RATE: Refusal.RATE_LIMIT_EXCEEDED, Over.BUDGET: Refusal.INSUFFICIENT_QUOTA}


@dataclass(frozen=True, slots=True)
class Pass:
    """An admitted request's reservation (in this instance's ledger, or the cluster's), and its response's headers."""

    ticket: Ticket | ClusterTicket
    headers: tuple[tuple[str, str], ...] = ()
    # The ledger the ticket is in (None: the cluster's), and what the book needs of a shared one.
    ledger: Budgets | None = None
    tenant: str = ""
    model: str = ""
    over: bool = False



class GatedStream(Protocol):
    """What the gate reads and writes of a request's stream (``ext_proc/attach/base.py``'s ``Stream``): its fields,
    the headers its release sets, the pass it carries to its end and the usage its response reported. Named here,
    so the budgets import nothing of the stream handling that builds them."""

    fields: RequestFields
    headers: tuple[tuple[str, str], ...]
    ticket: object
    usage: UsageReader | None


class BudgetGate:
    """The processor's one :class:`~extproc.core.budgets.ledger.Budgets`, asked at admission and told at the end."""

    def __init__(self, settings: BudgetSettings, lowest_band: int, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.budgets = Budgets(plan(settings))
        self.settings = settings
        self._lowest = lowest_band
        # Requests over a limit, by (tenant, limit kind, action): the metrics read it.
        self.over: Counter[tuple[str, str, str]] = Counter()
        # What was charged since start, by (tenant, model): requests, input, cached, output tokens, cost (the metrics').
        self.usage: dict[tuple[str, str], list[float]] = {}
        # With cluster: the counts in Redis; and this instance's share while Redis is away (same book).
        self.shared: ClusterBudgets | None = None
        self._standings: ClusterStandings | None = None
        self._alone: Budgets | None = None
        self._alone_instances = 0
        self._warned = False

    def share(self, shared: ClusterBudgets) -> None:
        """Count in the cluster's Redis from the next request on (``cluster:``)."""
        self.shared = shared
        self._standings = ClusterStandings(shared, self._clock)

    def reconfigure(self, settings: BudgetSettings, lowest_band: int) -> None:
        """New limits from the next request on (a reload); every count is kept."""
        self.settings = settings
        self._lowest = lowest_band
        self.budgets.reconfigure(plan(settings), self._clock())
        self._alone_instances = 0  # the share is taken again from the new plan when next needed

    async def enter(self, admission: Admission, stream: GatedStream, dispatcher: ModelDispatcher,
                    content_length: int | None) -> Admission:
        """Before the submit: ``admission`` as it goes on (:meth:`admit`, on what its model's cost model expects of
        it); raises the refusal. Its pass is kept on ``stream`` for :meth:`leave`, its rate headers for its release."""
        expected = dispatcher.expect(admission.tenant, content_length, max_tokens(stream.fields))
        admission, passed = await self.admit(admission, expected)
        stream.headers = passed.headers
        stream.ticket = passed
        return admission

    def leave(self, stream: GatedStream, held: Held | None) -> None:
        """The request's end (``held`` None: refused before it was queued): its pass, if it has one, settled once
        (:meth:`end`) on the usage its response reported."""
        passed, stream.ticket = stream.ticket, None
        if isinstance(passed, Pass):
            self.end(passed, held, None if stream.usage is None else stream.usage.reported)

    async def admit(self, admission: Admission, expected: tuple[float, float]) -> tuple[Admission, Pass]:
        """``admission`` as it goes on (downgraded over a limit with that action) and its pass; raises the refusal.

        ``expected``: the prompt and output tokens the model's cost model
        expects of it (its ``max_tokens``, clamped, else the tenant's average).
        """
        now = self._clock()
        usage = Usage(expected[0], 0.0, expected[1])
        if self.shared is not None:
            try:
                found = await self._admit_shared(self.shared, admission, usage, now)
            except (RedisError, OSError, TimeoutError) as exc:
                if not self._warned:
                    self._warned = True
                    log.warning("budgets: Redis unreachable (%s); enforcing this instance's share of each limit", exc)
            else:
                self._warned = False
                return found
        return self._admit_here(self._ledger(now), admission, usage, now)

    def _ledger(self, now: float) -> Budgets:
        """This instance's own ledger: alone, or its share of the cluster's limits while Redis is away."""
        if self.shared is None:
            return self.budgets
        instances = max(1, self.shared.instances())
        if self._alone is None:
            self._alone = Budgets(share(self.budgets.plan, instances), self.budgets.book)
            self._alone_instances = instances
        elif self._alone_instances != instances:
            self._alone.reconfigure(share(self.budgets.plan, instances), now)
            self._alone_instances = instances
        return self._alone

    def _admit_here(self, budgets: Budgets, admission: Admission, usage: Usage, now: float) -> tuple[Admission, Pass]:
        verdict = budgets.admit(admission.tenant, admission.model, usage, now)
        over = verdict.over
        headers: tuple[tuple[str, str], ...] = ()
        if over is not None or self.settings.rate_headers:
            headers = rate_headers(budgets.view(admission.tenant, admission.model, now))
        passed = Pass(verdict.ticket, headers, budgets, admission.tenant, admission.model, over is not None)
        if over is None:
            return admission, passed
        return self._over(admission, passed, over, verdict.action, verdict.retry_after_s, verdict.reason)

    async def _admit_shared(self, shared: ClusterBudgets, admission: Admission, usage: Usage,
                            now: float) -> tuple[Admission, Pass]:
        budgets = self.budgets
        found = meters(budgets.plan, admission.tenant, admission.model, now, shared.calendar)
        cost = budgets.plan.price(admission.model).cost(usage.input_tokens, 0.0, usage.output_tokens)
        reserve = amounts(found, usage, cost)
        ticket = ClusterTicket(found, reserve, rated=True)
        if not found:
            return admission, Pass(ticket, (), None, admission.tenant, admission.model)
        verdict = await shared.admit(found, reserve, now)
        over = verdict.over
        headers = rate_headers(view(found, verdict.used)) if over is not None or self.settings.rate_headers else ()
        if over is None:
            return admission, Pass(ticket, headers, None, admission.tenant, admission.model)
        action = budgets.plan.tenant(admission.tenant).action
        if action is Action.REFUSE:
            ticket.open = False
        else:  # served over the limit: counted (a downgrade in the periods only), whatever the limits
            ticket.rated = action is Action.REPORT
            kept = tuple(amount if ticket.rated or meter.kind == "p" else 0.0 for meter, amount in zip(found, reserve,
                                                                                                      strict=True))
            ticket = ClusterTicket(found, kept, ticket.rated)
            await shared.admit(found, kept, now, check=False)
        passed = Pass(ticket, headers, None, admission.tenant, admission.model, True)
        named = found[verdict.at]
        reason = f"{over_reason(named.scope, named.limit_name, named.limit)} (cluster-wide)"
        return self._over(admission, passed, over, action, verdict.wait, reason)

    def _over(self, admission: Admission, passed: Pass, over: Over, action: Action, wait: float,
              reason: str) -> tuple[Admission, Pass]:
        """Over a limit: refused (raises), downgraded to the lowest class, or reported."""
        self.over[(admission.tenant, over.value, action.value)] += 1
        if action is Action.REFUSE:
            # OpenAI's retry-after-ms too: the SDKs read it first, to the millisecond.
            headers = (*passed.headers, ("retry-after-ms", str(math.ceil(wait * 1000))))
            raise Refused(REFUSALS[over], f"{reason}; room again in {wait:.0f} s", retry_in_s=wait,
                          headers=(*headers, NO_RETRY) if over is Over.BUDGET else headers)
        if action is Action.DOWNGRADE and admission.band < self._lowest:
            asked = admission.band if admission.requested is None else admission.requested
            admission = replace(admission, band=self._lowest, requested=asked)
        return admission, passed

    async def refresh(self) -> None:
        """With a cluster, read the limits as they stand from Redis (when due): before the metrics or status are read."""
        if self._standings is not None:
            await self._standings.refresh(self.budgets.plan)

    def standings(self) -> tuple[list[Standing], bool]:
        """Each limit of each named scope (a tenant under ``budgets.tenants``, its models, a group) as it stands, and
        whether that is stale (a cluster's Redis did not answer the last read: the rows are that read's, or none).

        Unnamed tenants (those of ``default``) are many, and in the export. With a cluster the rows are the
        cluster's counts as last read from Redis (:meth:`refresh`), never this instance's own.
        """
        if self._standings is not None:
            return self._standings.rows, self._standings.stale
        named = self.budgets.plan.tenants
        return [s for s in self.budgets.standings(self._clock())
                if s.scope.kind is Kind.GROUP or s.scope.name in named], False

    def named(self) -> list[dict[str, object]]:
        """The status page's rows: :meth:`standings`, each saying whether it is stale."""
        rows, stale = self.standings()
        return [{"scope": s.scope.kind.value, "name": s.scope.name, "model": s.scope.model, "limit": s.limit,
                 "value": s.value, "used": s.used, "remaining": s.remaining, "reset_s": s.reset_s, "stale": stale}
                for s in rows]

    def end(self, passed: Pass, held: Held | None, reported: Reported | None = None) -> None:
        """The request's stream is over: charged what it used if it was served (``held``: None if never queued).

        What it used is what the engine ``reported`` in its response, where it
        did; else what the cost model measured. Cached prompt tokens the engine
        does not count are the prefix-cache account's (``charge``), as without a report.
        """
        now = self._clock()
        ticket = passed.ticket
        charge = held.charge if held is not None else None
        served = held is not None and charge is not None and held.served
        if not served or held is None or charge is None:
            if isinstance(ticket, ClusterTicket):
                if self.shared is not None:
                    self.shared.correct(ticket, None, now)
            elif passed.ledger is not None:
                passed.ledger.cancel(ticket, now)
            return
        if reported is None:
            used = Usage(held.estimate.prompt_tokens, charge.cached_tokens, charge.output_tokens)
        else:
            cached = charge.cached_tokens if reported.cached_tokens is None else reported.cached_tokens
            used = Usage(reported.prompt_tokens, cached, reported.completion_tokens)
        day = self.budgets.calendar_day(now)
        if isinstance(ticket, ClusterTicket):
            cost = self.budgets.plan.price(passed.model).cost(used.input_tokens, used.cached_tokens, used.output_tokens)
            if self.shared is not None:
                self.shared.correct(ticket, amounts(ticket.meters, used, cost), now,
                                    cluster_usage.charge(passed.tenant, passed.model, day, used, cost, passed.over))
            self.budgets.book.add(passed.tenant, passed.model, day, used, cost, over=passed.over)
        else:
            assert passed.ledger is not None
            cost = passed.ledger.settle(ticket, used, now)
            if self.shared is not None:  # decided on this instance's share (Redis away): its charge is the cluster's too
                self.shared.record(cluster_usage.charge(passed.tenant, passed.model, day, used, cost, passed.over), now)
        totals = self.usage.get((passed.tenant, passed.model))
        if totals is None:
            totals = self.usage[(passed.tenant, passed.model)] = [0.0] * 5
        totals[0] += 1
        totals[1] += used.input_tokens
        totals[2] += used.cached_tokens
        totals[3] += used.output_tokens
        totals[4] += cost

