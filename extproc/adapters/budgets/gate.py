"""Each request's budget check at admission, and its settlement when its stream ends.

The servicer asks :meth:`BudgetGate.admit` once it knows the tenant, the model
and the class, before the request is queued: within its limits the request
goes on with its reservation made (and its rate headers, when the config
wants them on responses); over one, the tenant's action decides (core:
``Verdict``): ``refuse`` raises the 429 (``rate_limit_exceeded`` or
``insufficient_quota``, with ``Retry-After`` when there is room again and the
rate headers), ``downgrade`` moves the request to the lowest class, ``report``
lets it go as it is. Whatever then happens, the servicer hands the pass back
with the request's :class:`~extproc.core.held.Held` (:meth:`BudgetGate.end`):
served, it is charged what the cost model measured at its end; not served
(refused in the queue, its client gone while queued, preempted before its
response began), nothing.

Time is the wall clock: budgets are per calendar day and month (UTC).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from extproc.adapters.budgets.headers import NO_RETRY, rate_headers
from extproc.adapters.config.budgets import BudgetSettings, plan
from extproc.adapters.ext_proc.admission import Admission
from extproc.core.budgets.book import Usage
from extproc.core.budgets.ledger import Budgets, Over, Ticket
from extproc.core.held import Held
from extproc.core.outcomes import Refusal, Refused

REFUSALS = {Over.RATE: Refusal.RATE_LIMIT_EXCEEDED, Over.BUDGET: Refusal.INSUFFICIENT_QUOTA}


@dataclass(frozen=True, slots=True)
class Pass:
    """An admitted request's reservation, and the rate headers its response carries (empty: none)."""

    ticket: Ticket
    headers: tuple[tuple[str, str], ...] = ()


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

    def reconfigure(self, settings: BudgetSettings, lowest_band: int) -> None:
        """New limits from the next request on (a reload); every count is kept."""
        self.settings = settings
        self._lowest = lowest_band
        self.budgets.reconfigure(plan(settings), self._clock())

    def admit(self, admission: Admission, expected: tuple[float, float]) -> tuple[Admission, Pass]:
        """``admission`` as it goes on (downgraded over a limit with that action) and its pass; raises the refusal.

        ``expected``: the prompt and output tokens the model's cost model
        expects of it (its ``max_tokens``, clamped, else the tenant's average).
        """
        now = self._clock()
        budgets = self.budgets
        prompt, output = expected
        verdict = budgets.admit(admission.tenant, admission.model, Usage(prompt, 0.0, output), now)
        over = verdict.over
        headers: tuple[tuple[str, str], ...] = ()
        if over is not None or self.settings.rate_headers:
            headers = rate_headers(budgets.view(admission.tenant, admission.model, now))
        if over is None:
            return admission, Pass(verdict.ticket, headers)
        self.over[(admission.tenant, over.value, verdict.action.value)] += 1
        if verdict.refused:
            wait = verdict.retry_after_s
            # OpenAI's retry-after-ms too: the SDKs read it first, to the millisecond.
            headers = (*headers, ("retry-after-ms", str(math.ceil(wait * 1000))))
            raise Refused(REFUSALS[over], f"{verdict.reason}; room again in {wait:.0f} s", retry_in_s=wait,
                          headers=(*headers, NO_RETRY) if over is Over.BUDGET else headers)
        if verdict.downgraded and admission.band < self._lowest:
            asked = admission.band if admission.requested is None else admission.requested
            admission = replace(admission, band=self._lowest, requested=asked)
        return admission, Pass(verdict.ticket, headers)

    def end(self, passed: Pass, held: Held | None) -> None:
        """The request's stream is over: charged what it used if it was served (``held``: None if never queued)."""
        now = self._clock()
        charge = held.charge if held is not None else None
        if held is None or charge is None or not held.served:
            self.budgets.cancel(passed.ticket, now)
            return
        used = Usage(held.estimate.prompt_tokens, charge.cached_tokens, charge.output_tokens)
        cost = self.budgets.settle(passed.ticket, used, now)
        ticket = passed.ticket
        totals = self.usage.get((ticket.tenant, ticket.model))
        if totals is None:
            totals = self.usage[(ticket.tenant, ticket.model)] = [0.0] * 5
        totals[0] += 1
        totals[1] += used.input_tokens
        totals[2] += used.cached_tokens
        totals[3] += used.output_tokens
        totals[4] += cost
