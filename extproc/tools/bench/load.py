"""The open-loop load generator: who sends what, and when. Pure and seeded.

Open loop means arrival times are fixed in advance, whatever the system under
test does: a slow gateway cannot slow the clients down and so hide its own
latency (the "coordinated omission" of closed-loop load tools). Every arm of a
benchmark replays the very same plan.

All times and durations are in *model seconds* (simulated GPU time): the
runner multiplies them by the simulator's time scale, so a scenario keeps its
shape at any speed.

Each tenant stream draws from its own random generator, spawned from the
scenario seed and the stream's position, so adding a stream never changes the
requests of the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np


class Lengths(Protocol):
    """A distribution of token counts."""

    def sample(self, rng: np.random.Generator, n: int) -> list[int]: ...


@dataclass(frozen=True)
class LogNormal:
    """Log-normal token counts, the usual fit for chat prompt and answer lengths.

    ``median`` is e^mu; ``sigma`` the spread of the log (0.8 puts p99 at ~6x the
    median). Clipped to [lo, hi] so one draw cannot exceed the engine's context.
    """

    median: float
    sigma: float
    lo: int = 1
    hi: int = 1 << 20

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        draws = rng.lognormal(math.log(self.median), self.sigma, n)
        return [int(x) for x in np.clip(np.rint(draws), self.lo, self.hi)]


@dataclass(frozen=True)
class Pareto:
    """Pareto (power-law) token counts: most are near ``scale``, a few are huge.

    ``alpha`` below 2 has infinite variance: document-sized prompts that
    dominate the cost. Clipped to ``hi``.
    """

    scale: float
    alpha: float
    hi: int = 1 << 20

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        draws = self.scale * (1.0 + rng.pareto(self.alpha, n))
        return [int(x) for x in np.clip(np.rint(draws), 1, self.hi)]


@dataclass(frozen=True)
class Stream:
    """One tenant's traffic: a burst at ``start``, Poisson arrivals and/or one every ``every`` s in [start, end).

    ``rate`` is requests per model second (0: none); ``every`` the period of
    evenly spaced arrivals (0: none). ``stream`` False asks for the whole answer
    at once (a non-streamed completion, as batch clients send). ``stop_after``
    names a tenant: once every request of that tenant has been answered, this
    stream sends no more (chats "until the batch is done"); the runner applies
    it, the plan lists every request up to ``end``.
    """

    tenant: str
    prompt: Lengths
    output: Lengths
    rate: float = 0.0
    start: float = 0.0
    end: float = 0.0
    burst: int = 0
    priority: str | None = None  # None: the gateway's default class
    every: float = 0.0
    stream: bool = True
    stop_after: str | None = None
    # Shared prefixes. RAG: each request starts with one of ``documents`` documents of
    # ``document_tokens``, drawn at random, then its own prompt (its question). Chats: requests are
    # the turns of ``chats`` conversations in turn, and a turn starts with its chat's whole history
    # (each earlier turn's prompt and answer), then its own prompt.
    documents: int = 0
    document_tokens: int = 0
    chats: int = 0


@dataclass(frozen=True)
class Planned:
    """One request of the plan.

    ``prefix`` names the text its prompt starts with (shared with every request
    of the same name: a document, a chat's history) and ``prefix_tokens`` how
    much of it; "" none. ``prompt_tokens`` counts the prefix in; a chat turn's
    prompt is all its chat's text (``prefix_tokens == prompt_tokens``): a
    longer cut of one name's text starts with every shorter one.
    """

    at: float
    tenant: str
    priority: str | None
    prompt_tokens: int
    max_tokens: int
    stream: bool = True
    stop_after: str | None = None
    prefix: str = ""
    prefix_tokens: int = 0


def poisson_times(rng: np.random.Generator, rate: float, start: float, end: float) -> list[float]:
    """Arrival times of a Poisson process of ``rate`` per second in [start, end)."""
    if rate <= 0 or end <= start:
        return []
    # Draw gaps in chunks until the window is covered; the expected count plus
    # six standard deviations almost always suffices in one go.
    expected = rate * (end - start)
    times: list[float] = []
    t = start
    while True:
        gaps = rng.exponential(1.0 / rate, int(expected + 6 * math.sqrt(expected) + 10))
        for gap in gaps:
            t += float(gap)
            if t >= end:
                return times
            times.append(t)


def periodic_times(every: float, start: float, end: float) -> list[float]:
    """One arrival every ``every`` seconds from ``start``, before ``end``."""
    if every <= 0 or end <= start:
        return []
    times = (start + k * every for k in range(math.ceil((end - start) / every) + 1))
    return [t for t in times if t < end]


def stream_requests(stream: Stream, rng: np.random.Generator) -> list[Planned]:
    times = [stream.start] * stream.burst + poisson_times(rng, stream.rate, stream.start, stream.end)
    times += periodic_times(stream.every, stream.start, stream.end)
    prompts = stream.prompt.sample(rng, len(times))
    outputs = stream.output.sample(rng, len(times))
    prefixes = _prefixes(stream, rng, prompts, outputs)
    return [
        Planned(t, stream.tenant, stream.priority, total, o, stream.stream, stream.stop_after, name, shared)
        for t, o, (name, shared, total) in zip(times, outputs, prefixes, strict=True)
    ]


def _prefixes(
    stream: Stream, rng: np.random.Generator, prompts: list[int], outputs: list[int]
) -> list[tuple[str, int, int]]:
    """Each request's shared prefix (name, its tokens, the prompt's tokens in all), in the order of its times.

    A RAG question is its document and then its own ``prompts`` tokens. A chat
    turn is its chat's text entire: the history (every earlier turn's prompt and
    answer) and its own question, which the next turn re-sends; so turn k's
    prompt starts with turn k-1's whole prompt, as a chat client's does.
    """
    if stream.documents:
        drawn = rng.integers(0, stream.documents, len(prompts))
        return [(f"{stream.tenant}-doc{int(d)}", stream.document_tokens, stream.document_tokens + p)
                for d, p in zip(drawn, prompts, strict=True)]
    if stream.chats:
        history = [0] * stream.chats
        out = []
        for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            chat = i % stream.chats
            out.append((f"{stream.tenant}-chat{chat}", history[chat] + prompt, history[chat] + prompt))
            history[chat] += prompt + output
        return out
    return [("", 0, p) for p in prompts]


def plan(streams: Sequence[Stream], seed: int) -> list[Planned]:
    """Every request of ``streams``, in arrival order; the same seed gives the same plan."""
    children = np.random.SeedSequence(seed).spawn(len(streams))
    requests = [
        r for s, child in zip(streams, children, strict=True) for r in stream_requests(s, np.random.default_rng(child))
    ]
    # Stable sort on time only: a burst keeps its order, streams keep theirs on ties.
    return sorted(requests, key=lambda r: r.at)


def subplan(requests: Sequence[Planned], tenants: frozenset[str], duration: float | None = None) -> list[Planned]:
    """The requests of ``tenants`` alone, moved to start at 0, and only those within ``duration`` of the first.

    The same requests as in the whole plan (same sizes, same spacing): a
    reference phase replays them without the others.
    """
    mine = [r for r in requests if r.tenant in tenants]
    if not mine:
        return []
    first = mine[0].at
    return [
        replace(r, at=r.at - first) for r in mine if duration is None or r.at - first < duration
    ]
