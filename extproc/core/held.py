"""One held request, in two parts: what the adapter carries in, and what the core decides of it.

:class:`Request` is what the adapter submitted (who asks, in which band, where
it may go, what its prompt shares with others): fixed for the request's life,
so nothing the core does can change what was asked. :class:`Held` is the
core's record of it: the future the adapter awaits, and every decision the
core takes about the request (its estimate, its deadline, its release and
where to, whether it can be preempted, its state). The core writes ``Held``;
the adapter awaits its ``future``, reads the release (``endpoint``,
``fallbacks``, ``checked``) and the preemption signal (``preempted``, until
``started``), and hands the ``Held`` back (``ModelDispatcher.end``).

Neither part carries a callback: what a policy or the pricing asks of a
request is asked by the model's state (``model_state.py``), which owns the
answers. Both are slotted: ten thousand held requests cost their fields, no
``__dict__`` each.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from extproc.core.cost import Charge, Estimate
from extproc.core.prefix import NO_PREFIX, Prefix


@dataclass(frozen=True, slots=True)
class Request:
    """What the adapter submits of one request; the core only reads it."""

    tenant: str
    band: int
    # Prefix-cache affinity key (endpoint picking): requests that share a prompt prefix; the tenant when none.
    affinity: str
    # Its prompt's prefix signature (NO_PREFIX: the model computes none).
    prefix: Prefix = field(default=NO_PREFIX, repr=False)
    # The endpoints it may go to (a gateway's subset hint); None: any of the pool.
    eligible: frozenset[str] | None = None
    # The client says it is a retry (x-stainless-retry-count): never preempted.
    retried: bool = False
    # Its answer comes whole (not streamed): its response begins only as it completes, so it can be taken back
    # (preempted) until then. A stream's response begins as the engine accepts it.
    whole: bool = False
    # What the decision log names it by besides its tenant and class (a batch line: "<batch>/<line>");
    # the core only carries it into its reports.
    tag: str = ""


@dataclass(eq=False, slots=True)
class Held:
    """The core's record of one held request; identity-hashed so equal-looking requests stay distinct."""

    request: Request
    enqueued_at: float
    # Resolved at the release (the seconds it waited) or with the refusal; the adapter awaits it.
    future: asyncio.Future[float] = field(repr=False)
    # What the release is charged (vtc), priced at its endpoint's cache at the release, corrected when its stream ends.
    estimate: Estimate = field(repr=False)
    # Its time-to-first-token objective (the band's, tightened by the client's as
    # far as the band trusts it: Band.objective_s); None: none.
    ttft_objective_s: float | None
    # When it should be released by, for ordering (deadline policy): enqueued_at +
    # the objective, or + the band's longest queue wait where it has none.
    deadline: float
    # Refused (queue_timeout) if it is still queued this long after enqueued_at (``expiry.py``): its band's longest
    # wait when it was queued.
    queue_wait_s: float
    # Once released it keeps its slot to the end: a stream, or of a band that is not preemptible (decided as it is
    # queued, with the band's settings then; ModelState._firm).
    firm: bool = True
    released: bool = False
    released_at: float = math.nan
    # The endpoint picked at the release, and the others in order of preference (the gateway's fallbacks).
    endpoint: str | None = None
    fallbacks: tuple[str, ...] = ()
    # Whether its response's headers are read for a failed release (a sample: they cost a message).
    checked: bool = False
    # Resolved when it is preempted after its release: its stream answers 503 preempted.
    preempted: asyncio.Future[None] | None = field(default=None, repr=False)
    # Its response has begun (its headers came): it can no longer be preempted.
    started: bool = False
    # The engine refused it as full before starting it (its own queue cap): nothing was served.
    refused: bool = False
    ended: bool = False
    # When a preemptible request was last ended to make room for it (preemption.py).
    room_made_at: float = -math.inf
    # What it cost in the end, once its stream ended or it was preempted (the estimate, corrected: cost.py).
    charge: Charge | None = field(default=None, repr=False)

    @property
    def served(self) -> bool:
        """Released, not refused by the engine and not preempted before its response began: the engine worked for its
        client."""
        return self.released and not self.refused and (self.preempted is None or not self.preempted.done() or self.started)

    @property
    def objective_due(self) -> float | None:
        """When its TTFT objective runs out (``deadline`` without the queue-wait fallback); None: no objective."""
        return None if self.ttft_objective_s is None else self.enqueued_at + self.ttft_objective_s

    def slack_s(self, now: float) -> float | None:
        """Its objective's slack at ``now``: how long before its TTFT deadline (negative: past it); None: no objective."""
        due = self.objective_due
        return None if due is None else due - now
