"""The adaptive rule's limit: how many requests one engine endpoint should hold.

:class:`ConcurrencyLimit` learns, per endpoint, ``limit`` = the number of
requests the engine should hold at once (running + waiting). The adaptive
rule (adaptive.py) releases while the load estimate of what the engine holds
is below the limit, so a completion is refilled at once, without waiting for
the next scrape.

What is learned, and from which signal (every scrape, newest sample):

1. **Ceiling breached** (inter-token latency over ``max_itl_s`` or KV usage
   over ``max_kv_usage``) while the engine holds no more than the limit, so the
   limit is what caused it: multiplicative decrease (``DECREASE``), at most
   once per ITL window, and the ITL window restarts so the next decision sees
   only tokens generated after the cut.
2. **The engine queues** (waiting > 0): its batch is full, so the running
   count *is* its capacity right now (it changes with KV pressure and request
   lengths). ``limit = running + target_waiting`` — what the
   ``waiting_target`` rule keeps — but never below what the engine has shown
   it runs at once (``shown``: ``max_running`` when configured, else the most
   it was seen running): a burst that a page catches mid-step, or long
   prompts that fill the KV cache for a moment, must not cut the limit to a
   few requests for minutes. Growing beyond the current limit this way is
   bounded like 3.
3. **The engine ran everything** (waiting = 0) and holds about as much as the
   limit allows: it has spare capacity, so additive increase. The step is
   ``target_waiting`` (a queue that size is what the gate tolerates anyway, so
   a probe can never overfill the engine by more), 1 when a ceiling is
   within 50-90 % of its value, 0 above 90 %.
4. **The engine ran everything, and holds less than the limit allows**: its
   queue drained while the gate was not filling it (a lower class held back,
   nothing to send). The limit returns towards ``shown + target_waiting`` by
   the same step a scrape, whether or not the gate fills it: a limit cut by a
   burst recovers within a scrape or two, not only once someone fills it.
5. **The engine refused a request as full** (its own queue cap: vLLM's
   ``--max-num-queued-reqs``, TGI's ``--max-concurrent-requests``; seen as its
   rejection counter rising, or as a release answered "full"): something
   outside the gate — a client that bypasses it — fills the engine, or its cap
   is below what the gate would hold. Multiplicative decrease from what the
   engine held (``min(limit, held) * DECREASE``) once per round of refusals,
   and within a round at most once per ITL window, but never below what it was
   seen running: it ran that many within its cap, and the valve is met by its
   queue (a cut below its batch loses throughput and leaves the outside
   traffic room to run). No rule raises the limit until the engine has refused
   nothing for ``QUIET_S``: while refusals go on, growing back would find the
   valve again, and the gateway's retries of a refused request (Envoy's back-
   off) come less than that apart. Once they stop, the limit grows as rules
   2-4 say: a burst around the gateway came on top of what the gate holds and
   is over, so the limit is back at the line a second after it (a hold of
   fixed length would keep it under the engine's batch for that long, and the
   gateway's clients would pay for the bypassing client in throughput). If the
   engine refuses again within ``REFUSAL_HOLD_S`` of the last refusal, once
   the limit could grow, while it held about what the limit allows (as rule 3
   reads it) and no more, what the gate itself sends meets the cap (the cap is
   below the line; as in rule 1, the limit is to blame): a new decrease, and
   no growth until ``REFUSAL_HOLD_S`` after the last refusal, so each probe
   above such a cap costs one more round of refusals. Refusals while it held
   more (traffic around the gateway on top of the line, a burst that came in
   parts), or clearly less (traffic around the gateway the pages do not show
   yet), are a new round like the first.

The engine's own limits, where it says them (``set_engine``: SGLang's
``/server_info``, TGI's ``/info``, llama.cpp's ``/props``), join the
operator's: what it runs at once raises the floor of rule 2, and the most it
holds before refusing bounds the limit always.

Why AIMD and not a latency gradient (as in Netflix's Gradient2): a
continuous-batching engine's step time grows smoothly with the batch, with no
knee where throughput stops growing, so a gradient on latency would shrink the
batch and lose throughput against plain FIFO. The engine tells us when it is
full (it queues); latency only matters against an explicit ceiling. The
numbers behind this are in ``docs/gate.md``.

Pure: time is passed in.
"""

from __future__ import annotations

from collections import deque

from extproc.core.values.engine_load import EngineLoad

# Multiplicative decrease on a ceiling breach.
DECREASE = 0.8
# Fractions of a ceiling where additive increase slows to 1, then stops.
SLOW_ABOVE = 0.5
HOLD_ABOVE = 0.9
# After the engine refused a request as full: how long it must refuse nothing before the limit may grow
# (at least the longest back-off between the gateway's retries of a refused request, the generated Envoy's
# 1 s), and how long the limit may not grow after refusals that came again once it could.
QUIET_S = 1.0
REFUSAL_HOLD_S = 10.0


class ItlWindow:
    """Mean inter-token latency over the last ``window_s``, from cumulative counters."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._points: deque[tuple[float, float, float]] = deque()

    def add(self, at: float, total_s: float, count: float) -> None:
        if self._points and (count < self._points[-1][2] or total_s < self._points[-1][1]):
            self._points.clear()  # the engine restarted: counters went back to zero
        self._points.append((at, total_s, count))
        # Keep one point at or before the window's start as the baseline.
        while len(self._points) > 2 and self._points[1][0] <= at - self._window_s:
            self._points.popleft()

    def value(self) -> float | None:
        """Seconds per token over the window; None if no token was generated in it."""
        if len(self._points) < 2:
            return None
        (_, first_s, first_n), (_, last_s, last_n) = self._points[0], self._points[-1]
        return (last_s - first_s) / (last_n - first_n) if last_n > first_n else None

    def restart(self) -> None:
        """Forget tokens generated so far: measure only from the newest point on."""
        while len(self._points) > 1:
            self._points.popleft()


class ConcurrencyLimit:
    """AIMD estimate of how many requests one endpoint should hold (see module docstring)."""

    def __init__(
        self,
        initial: float,
        *,
        target_waiting: int,
        max_itl_s: float | None = None,
        max_kv_usage: float | None = None,
        itl_window_s: float = 2.0,
        cap: int | None = None,
        floor: int | None = None,
    ) -> None:
        self._target = target_waiting
        # What the engine runs at once, when the operator (max_running) or the engine says it.
        self._configured_floor = self._floor = floor or 0
        # The most requests the engine was seen running.
        self.peak = 0.0
        self._max_itl_s = max_itl_s
        self._max_kv = max_kv_usage
        self._cooldown_s = itl_window_s
        self._configured_cap = self._cap = cap
        self.itl = ItlWindow(itl_window_s)
        self.limit = float(min(initial, cap) if cap is not None else initial)
        self.pressure = 0.0
        self._last_decrease = float("-inf")
        # Rule 5: the last refusal, and whether refusals came again once the limit could grow (then it is
        # held for REFUSAL_HOLD_S).
        self._refused_at = float("-inf")
        self._refused_again = False

    def _pressure(self, load: EngineLoad) -> float:
        """The highest ceiling use, 1.0 = at a ceiling; 0 without ceilings or data."""
        ratios = [0.0]
        itl = self.itl.value()
        if self._max_itl_s is not None and itl is not None:
            ratios.append(itl / self._max_itl_s)
        if self._max_kv is not None and load.kv_usage is not None:
            ratios.append(load.kv_usage / self._max_kv)
        return max(ratios)

    def observe(self, load: EngineLoad, at: float, *, held: float | None = None) -> None:
        """Update the limit from a scrape that started at ``at``.

        ``held`` is what the engine held then, when the caller knows better than
        the scrape (it counts its own requests exactly, and a lagging scrape
        misses some): rule 3 grows the limit only when the engine was as full
        as the limit allows, and a lagging page would stall that.
        """
        if load.itl_sum is not None and load.itl_count is not None:
            self.itl.add(at, load.itl_sum, load.itl_count)
        self.pressure = pressure = self._pressure(load)
        self.peak = max(self.peak, load.running)
        if held is None:
            held = load.running + load.waiting
        before = self.limit
        self._grow_or_cut(load, at, held, pressure, self.shown)
        if self._holding(at):
            self.limit = min(self.limit, before)
        if self._cap is not None:
            self.limit = min(self.limit, float(self._cap))

    def set_engine(self, max_running: int | None, max_held: int | None) -> None:
        """What the engine says it runs at once and holds at most: a floor, and a cap that bounds the limit.

        A batch size it says counts as ``max_running`` does: the limit starts
        there (plus ``target_waiting``) instead of ramping up to it.
        """
        floor = max(self._configured_floor, max_running or 0)
        if floor > self._floor:
            self.limit = max(self.limit, float(floor + self._target))
        self._floor = floor
        caps = [c for c in (self._configured_cap, max_held) if c is not None]
        self._cap = min(caps) if caps else None
        if self._cap is not None:
            self.limit = min(self.limit, float(self._cap))

    @property
    def shown(self) -> float:
        """What the engine has shown it runs at once: ``max_running`` when known, else the most seen."""
        return max(self._floor, self.peak)

    def refused(self, at: float, held: float) -> None:
        """The engine refused a request as full while holding ``held`` (rule 5).

        ``held`` may lag (a scrape's count): never read as less than the
        engine runs, or one stale page would cut the limit to nothing.
        """
        news = not self._holding(at)  # the limit could grow: a new round of refusals
        if news:  # soon after the last, the engine holding what the limit allows: the gate's own sends met the cap
            self._refused_again = (at - self._refused_at < REFUSAL_HOLD_S
                                   and self.limit - self._target / 2 <= held <= self.limit)
        self._refused_at = max(self._refused_at, at)
        if news or at - self._last_decrease >= self._cooldown_s:
            seen = min(self.limit, self.peak)  # it ran that many within its cap: never cut below
            self.limit = max(1.0, seen, min(self.limit, max(held, self.shown)) * DECREASE)
            self._last_decrease = at

    def _holding(self, at: float) -> bool:
        """Whether rule 5 keeps the limit from growing: refusals go on, or came again after it could grow."""
        since = at - self._refused_at  # a page that started before the last refusal tells nothing after it
        return since < QUIET_S or (self._refused_again and since < REFUSAL_HOLD_S)

    def _grow_or_cut(self, load: EngineLoad, at: float, held: float, pressure: float, shown: float) -> None:
        """Rules 1-4."""
        step = self._target if pressure < SLOW_ABOVE else 1 if pressure < HOLD_ABOVE else 0
        if pressure > 1.0:
            if held <= self.limit and at - self._last_decrease >= self._cooldown_s:
                self.limit = max(1.0, self.limit * DECREASE)
                self._last_decrease = at
                self.itl.restart()
        elif load.waiting > 0:
            measured = load.running + self._target
            if measured <= self.limit:  # a ceiling's cut below what it has shown is kept
                self.limit = max(measured, min(self.limit, shown))
            else:
                self.limit = max(self.limit, load.running + step)
        elif held >= self.limit - self._target / 2:
            self.limit = max(self.limit, load.running + step)
        else:
            self.limit = max(self.limit, min(shown + self._target, self.limit + step))
