"""The simulator's prefix cache (``extproc-dev sim --prefix-caching``): vLLM's automatic prefix caching.

The pure block pool and scheduler first (what hits, what is shared, what is
evicted, what a hit saves), then the real HTTP server: TTFT measured by a
streaming client and the counters on ``/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.tools.realvllm import BLOCK_SIZE, REQUEST_EXTRAS
from extproc.tools.sim import RunningSim, SimSettings, add_arguments, start_sim
from extproc.tools.sim.engine import Scheduler, SimRequest
from extproc.tools.sim.kvcache import BlockPool, block_hashes
from extproc.tools.sim.server import prompt_units, settings_from_args
from tests.vllmutil import FCFS, FCFS_MODEL, PRIORITY, VllmServers

MODEL = "sim-model"
BLOCK = 4
VLLM_SERVERS = (FCFS, PRIORITY)  # the session's pair (the ``vllm`` fixture): its tests read the first


def _scheduler(**overrides: Any) -> Scheduler:
    options: dict[str, Any] = {"model": MODEL, "block_size": BLOCK, "prefix_caching": True, **overrides}
    return Scheduler(SimSettings(**options))


def _request(units: Sequence[Hashable], max_tokens: int = 2, block_size: int = BLOCK) -> SimRequest:
    return SimRequest(len(units), max_tokens, arrival=0.0, block_hashes=block_hashes(units, block_size))


def _run(scheduler: Scheduler, request: SimRequest, now: float = 0.0) -> float:
    """Run ``request`` alone to its end; returns the duration of the step that admitted (prefilled) it."""
    scheduler.add(request)
    first = scheduler.schedule(now)
    assert first.admitted == (request,)
    now += first.duration
    scheduler.complete(now)
    while scheduler.has_work:
        now += scheduler.schedule(now).duration
        scheduler.complete(now)
    return first.duration


def _text(seed: str, tokens: int) -> list[str]:
    """``tokens`` distinct units starting with ``seed``."""
    return [f"{seed}{i}" for i in range(tokens)]


# --------------------------------------------------------------------------
# Pure: hashing, the pool, the scheduler
# --------------------------------------------------------------------------


@pytest.mark.unit
def test_block_hashes_are_chained_over_full_blocks_only() -> None:
    a = block_hashes(list("abcdefghij"), 4)
    assert len(a) == 2  # "ij" is a partial block: never hashed, never cached
    assert block_hashes(list("abcdefghXX"), 4) == a  # equal first 8 units: equal hashes
    b = block_hashes(list("abcXefgh"), 4)
    assert b[0] != a[0] and b[1] != a[1]  # a difference in block 0 changes every later hash (chained)
    c = block_hashes(list("abcdXfgh"), 4)
    assert c[0] == a[0] and c[1] != a[1]


@pytest.mark.unit
def test_prompt_units_are_the_token_estimate_and_keep_leading_text() -> None:
    text = "The system prompt. " * 10
    assert len(prompt_units(text)) == -(-len(text) // 4)
    assert prompt_units(text + "question one")[:47] == prompt_units(text + "question two")[:47]
    assert prompt_units("") == [""]  # the empty prompt is still one token, as estimate_tokens says


@pytest.mark.unit
def test_repeated_prompt_hits_all_but_its_last_block_and_skips_that_prefill() -> None:
    scheduler = _scheduler(prefill_ms_per_token=1.0)
    prompt = _text("p", 16)  # 4 full blocks
    cold = _run(scheduler, _request(prompt))
    again = _request(prompt)
    warm = _run(scheduler, again)
    # vLLM recomputes at least the last token; num_computed_tokens is block-aligned, so the whole last block.
    assert again.num_cached_tokens == 12
    assert (scheduler.prefix_queries, scheduler.prefix_hits) == (32, 12)
    assert cold - warm == pytest.approx(12 * 1.0 / 1000.0)  # exactly the 12 tokens not prefilled


@pytest.mark.unit
def test_a_different_prompt_shares_only_its_common_leading_blocks() -> None:
    scheduler = _scheduler()
    _run(scheduler, _request(_text("p", 16)))
    other = _request(_text("p", 9) + _text("q", 7))  # units 0-8 equal: blocks 0 and 1 (units 0-7) are common
    _run(scheduler, other)
    assert other.num_cached_tokens == 8
    assert _request(_text("z", 16)).block_hashes[0] not in {*_request(_text("p", 16)).block_hashes}


@pytest.mark.unit
def test_running_requests_share_cached_blocks_and_free_cached_blocks_count_as_free() -> None:
    scheduler = _scheduler(kv_cache_tokens=64)
    prompt = _text("p", 16)
    first, second = _request(prompt, max_tokens=4), _request(prompt, max_tokens=4)
    scheduler.add(first)
    scheduler.add(second)
    step = scheduler.schedule(0.0)
    assert step.admitted == (first, second)
    # vLLM caches a request's full blocks as it is scheduled: the second one, same step, already hits them.
    assert second.num_cached_tokens == 12
    assert first.kv_block_ids[:3] == second.kv_block_ids[:3]
    assert scheduler.kv_used == (first.kv_blocks + second.kv_blocks - 3) * BLOCK  # 3 blocks held twice, stored once
    now = step.duration
    while scheduler.has_work:
        scheduler.complete(now)
        now += scheduler.schedule(now).duration
    assert scheduler.kv_usage == 0.0  # the gauge: cached but free is free
    assert scheduler.pool is not None and scheduler.pool.num_cached == 4


@pytest.mark.unit
def test_kv_pressure_evicts_the_least_recently_freed_prefix_first() -> None:
    # 12 blocks; each request reserves 4 (3 prompt blocks, 1 for its 4 output tokens).
    scheduler = _scheduler(kv_cache_tokens=12 * BLOCK)
    a, b, c = (_text(seed, 12) for seed in "abc")
    for prompt in (a, b, c):
        _run(scheduler, _request(prompt, max_tokens=4))
    pool = scheduler.pool
    assert pool is not None

    def cached(prompt: list[str]) -> int:
        return len(pool.lookup(block_hashes(prompt, BLOCK), 10**6))

    assert [cached(p) for p in (a, b, c)] == [3, 3, 3]  # all free, all cached
    _run(scheduler, _request(_text("d", 12), max_tokens=4))
    # d took the 3 never-hashed blocks (freed first: vLLM reuses uncached blocks first), then a's last block:
    # a was freed first, and a request's blocks are freed tail first.
    assert [cached(p) for p in (a, b, c)] == [2, 3, 3]
    # e takes d's output block (never hashed: reused first), a's last two, then b's last: b was freed after a.
    _run(scheduler, _request(_text("e", 12), max_tokens=4))
    assert [cached(p) for p in (a, b, c)] == [0, 2, 3]


@pytest.mark.unit
def test_a_hit_on_free_blocks_counts_them_as_taken_from_the_free_queue() -> None:
    pool = BlockPool(4, BLOCK, caching=True)
    hashes = block_hashes(_text("p", 12), BLOCK)
    held: list[int] = []
    pool.allocate(held, [], 4, hashes)
    pool.free(held)
    hit = pool.lookup(hashes, 13)
    assert len(hit) == 3 and pool.num_free == 4
    assert pool.can_allocate(hit, 4)  # 3 reused + 1 new = the 4 free blocks
    assert not pool.can_allocate(hit, 5)


@pytest.mark.unit
def test_incremental_mode_hits_too_and_a_resumed_request_is_not_counted_again() -> None:
    scheduler = _scheduler(kv_mode="incremental", kv_cache_tokens=8 * BLOCK, prefill_ms_per_token=1.0)
    prompt = _text("p", 16)
    _run(scheduler, _request(prompt, max_tokens=2))
    again = _request(prompt, max_tokens=2)
    _run(scheduler, again)
    assert again.num_cached_tokens == 12 and scheduler.prefix_hits == 12
    # Two requests that outgrow 8 blocks: the later one is preempted, and resumes on its cached prompt blocks.
    x, y = _request(_text("x", 12), max_tokens=10), _request(_text("y", 12), max_tokens=10)
    scheduler.add(x)
    scheduler.add(y)
    queries = scheduler.prefix_queries
    now = 0.0
    while scheduler.has_work:
        now += scheduler.schedule(now).duration
        scheduler.complete(now)
    assert scheduler.num_preemptions >= 1
    assert scheduler.prefix_queries == queries + 24  # each counted once, at its first admission


@pytest.mark.unit
def test_off_by_default_never_hits_and_keeps_the_timing() -> None:
    assert SimSettings(model=MODEL).prefix_caching is False
    args = argparse.ArgumentParser()
    add_arguments(args)
    assert settings_from_args(args.parse_args(["--model", MODEL])).prefix_caching is False
    assert settings_from_args(args.parse_args(["--model", MODEL, "--prefix-caching"])).prefix_caching is True

    settings = SimSettings(model=MODEL, block_size=BLOCK)
    scheduler = Scheduler(settings)
    prompt = _text("p", 16)
    durations = []
    for _ in range(2):
        request = _request(prompt)
        durations.append(_run(scheduler, request))
        assert request.num_cached_tokens == 0
    assert scheduler.pool is None and scheduler.prefix_queries == scheduler.prefix_hits == 0
    step = (settings.step_ms + settings.step_ms_per_seq + settings.prefill_ms_per_token * 16) / 1000.0
    assert durations == [pytest.approx(step)] * 2  # the whole prompt prefilled every time, as before


@pytest.mark.unit
def test_prefix_caching_needs_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of block_size"):
        SimSettings(model=MODEL, prefix_caching=True, block_size=16, kv_cache_tokens=1000)


# --------------------------------------------------------------------------
# Through the real HTTP server
# --------------------------------------------------------------------------

# 0.2 ms of (scaled) prefill per token on top of 2 ms steps: a 2000-token prompt costs ~400 ms to prefill.
TIMED: dict[str, Any] = {"step_ms": 20.0, "step_ms_per_seq": 0.5, "prefill_ms_per_token": 2.0, "time_scale": 0.1}
LONG = "Shared system prompt, a document under review. " * 170  # ~8000 characters: 2000 tokens


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _ttft(http: aiohttp.ClientSession, sim: RunningSim, content: str) -> float:
    """Seconds from sending a streamed chat request to its first content chunk; drains the rest."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, "stream": True}
    start = time.monotonic()
    first: float | None = None
    async with http.post(f"{sim.url}/v1/chat/completions", json=body) as response:
        assert response.status == 200
        async for line in response.content:
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic() - start
    assert first is not None
    return first


async def _samples(http: aiohttp.ClientSession, sim: RunningSim) -> dict[str, list[tuple[dict[str, str], float]]]:
    async with http.get(f"{sim.url}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def _one(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    (labels, value), = samples[name]
    assert labels["model_name"] == MODEL and labels["engine"] == "0"
    return value


@pytest.mark.integration
@pytest.mark.alone
async def test_a_repeated_long_prompt_is_a_hit_and_its_ttft_is_shorter_by_the_prefill_saved(
    http: aiohttp.ClientSession,
) -> None:
    settings = SimSettings(model=MODEL, prefix_caching=True, **TIMED)
    async with await start_sim(settings) as sim:
        tokens = len(prompt_units(LONG))
        cold = await _ttft(http, sim, LONG)
        warm = await _ttft(http, sim, LONG)
        hit = (tokens - 1) // settings.block_size * settings.block_size
        saved = hit * settings.prefill_ms_per_token * settings.time_scale / 1000.0
        assert 0.6 * saved < cold - warm < 1.4 * saved, (cold, warm, saved)

        samples = await _samples(http, sim)
        queries = _one(samples, "vllm:prefix_cache_queries_total")
        hits = _one(samples, "vllm:prefix_cache_hits_total")
        assert (queries, hits) == (2 * tokens, hit)
        assert (queries, hits) == (sim.engine.scheduler.prefix_queries, sim.engine.scheduler.prefix_hits)
        (info, one), = samples["vllm:cache_config_info"]
        assert one == 1.0
        assert info["block_size"] == "16" and info["enable_prefix_caching"] == "True"
        assert (int(info["num_gpu_blocks"]) - 1) * 16 == settings.kv_cache_tokens  # vLLM counts its null block
        assert _one(samples, "vllm:kv_cache_usage_perc") == 0.0  # both ended: their cached blocks are free


@pytest.mark.integration
@pytest.mark.alone
async def test_a_different_prompt_hits_only_the_shared_leading_text(http: aiohttp.ClientSession) -> None:
    async with await start_sim(SimSettings(model=MODEL, prefix_caching=True, **TIMED)) as sim:
        await _ttft(http, sim, LONG + " first question?")
        shared = len(LONG) // 4 // 16 * 16  # the full blocks of the common text
        await _ttft(http, sim, LONG + " another, longer question?")
        await _ttft(http, sim, "Unrelated. " + LONG)
        samples = await _samples(http, sim)
        assert _one(samples, "vllm:prefix_cache_hits_total") == shared  # the third shares no leading block


@pytest.mark.integration
@pytest.mark.alone
async def test_off_by_default_the_same_prompt_costs_the_same_and_nothing_is_counted(
    http: aiohttp.ClientSession,
) -> None:
    async with await start_sim(SimSettings(model=MODEL, **TIMED)) as sim:
        cold = await _ttft(http, sim, LONG)
        again = await _ttft(http, sim, LONG)
        assert again > 0.6 * cold  # no prefill skipped (a hit would save ~90% of it)
        samples = await _samples(http, sim)
        assert _one(samples, "vllm:prefix_cache_queries_total") == 0
        assert _one(samples, "vllm:prefix_cache_hits_total") == 0
        (info, _), = samples["vllm:cache_config_info"]
        assert info["enable_prefix_caching"] == "False"


async def _prefix_counters(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    }
    return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]


async def _send_each(
    http: aiohttp.ClientSession, url: str, prompts: list[list[int]], times: int
) -> tuple[float, float]:
    """The counters' growth over each prompt sent ``times`` times, one after the other (token ids: no tokenizer between)."""
    queries, hits = await _prefix_counters(http, url)
    for ids in prompts:
        for _ in range(times):
            body = {"model": FCFS_MODEL, "prompt": ids, "max_tokens": 2, **REQUEST_EXTRAS}
            async with http.post(f"{url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                await response.read()
    expected = times * sum(len(ids) for ids in prompts)
    deadline = time.monotonic() + 10.0
    while (now := await _prefix_counters(http, url))[0] - queries < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # vLLM's page shows a step's stats a moment after it
    return now[0] - queries, now[1] - hits


@pytest.mark.integration
@pytest.mark.alone
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_the_simulator_counts_prefix_queries_and_hits_as_real_vllm_does(vllm: VllmServers) -> None:
    # Fresh random token ids, so no earlier test of the session has them cached: 300 tokens (2 full blocks and
    # 44 more: the second send hits both), and exactly 2 blocks (the second hits 1: the last token is recomputed).
    rng = random.Random()
    prompts = [[rng.randrange(1, 1000) for _ in range(length)] for length in (300, 2 * BLOCK_SIZE)]
    async with aiohttp.ClientSession() as http:
        real = await _send_each(http, vllm.fcfs, prompts, times=2)
        async with await start_sim(_like_the_session_vllm()) as sim:
            simulated = await _send_each(http, sim.url, prompts, times=2)
    assert real == simulated == (2 * (300 + 256), 2 * BLOCK_SIZE + BLOCK_SIZE)


def _like_the_session_vllm() -> SimSettings:
    """The session's vLLM: 16 blocks of 128 (``realvllm.start_vllm`` for 4 sequences), one of them the null block."""
    return SimSettings(
        model=FCFS_MODEL, prefix_caching=True, block_size=BLOCK_SIZE, kv_cache_tokens=15 * BLOCK_SIZE, **TIMED
    )


async def _hits_per_request(http: aiohttp.ClientSession, url: str, prompts: list[list[int]]) -> list[int]:
    """Each prompt sent alone, in turn; the tokens each one found cached."""
    hits = []
    for ids in prompts:
        hits.append(int((await _send_each(http, url, [ids], times=1))[1]))
    return hits


# Prompts of 2-3 full blocks and a partial one, in an order found (by the simulator) to evict some
# prompts whole and one by its tail only; 14 or 16 usable blocks give other hits, so the order tells.
EVICTION_LENGTHS = (300, 400, 200, 450, 300, 400, 200, 300)
EVICTION_ORDER = (0, 1, 2, 3, 0, 1, 7, 4, 6, 1, 4, 5, 3, 4)
EVICTION_HITS = [0, 0, 0, 0, 256, 384, 0, 0, 0, 384, 256, 0, 128, 256]


@pytest.mark.integration
@pytest.mark.alone
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_the_simulator_evicts_what_real_vllm_evicts(vllm: VllmServers) -> None:
    # Every block of the session's vLLM is free now; what earlier tests left cached never matches fresh ids.
    rng = random.Random()
    distinct = [[rng.randrange(1, 1000) for _ in range(length)] for length in EVICTION_LENGTHS]
    prompts = [distinct[i] for i in EVICTION_ORDER]
    async with aiohttp.ClientSession() as http:
        real = await _hits_per_request(http, vllm.fcfs, prompts)
        async with await start_sim(_like_the_session_vllm()) as sim:
            simulated = await _hits_per_request(http, sim.url, prompts)
    assert real == simulated == EVICTION_HITS


FAST: dict[str, Any] = {"step_ms": 1.0, "visibility_delay_ms": 0.0, "visibility_delay_per_pending_ms": 0.0}


@pytest.mark.unit
async def test_a_continuation_as_vllm_takes_it_hits_the_first_requests_prompt(http: aiohttp.ClientSession) -> None:
    """A chat's answer so far as an open final assistant message, a completion's prompt followed by its text.

    The batch runner's chunks (adapters/batches/continuation.py) send these:
    each re-reads the prompt, whose full blocks the first request cached.
    """
    async with await start_sim(SimSettings(model=MODEL, prefix_caching=True, **FAST)) as sim:
        async def post(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            async with http.post(f"{sim.url}{path}", json={"model": MODEL, "max_tokens": 8, **body}) as response:
                return response.status, await response.json()

        question = [{"role": "user", "content": LONG}]
        status, first = await post("/v1/chat/completions", {"messages": question})
        assert status == 200
        text = first["choices"][0]["message"]["content"]
        continued = [*question, {"role": "assistant", "content": text}]
        status, refused = await post("/v1/chat/completions", {"messages": continued, "continue_final_message": True,
                                                              "add_generation_prompt": True})
        assert status == 400
        assert refused["error"]["message"] == ("Cannot set both `continue_final_message` and `add_generation_prompt` "
                                               "to True.")
        status, second = await post("/v1/chat/completions", {"messages": continued, "continue_final_message": True,
                                                             "add_generation_prompt": False})
        assert status == 200 and second["usage"]["prompt_tokens"] == len(prompt_units(LONG + text))
        chat_hit = len(LONG) // 4 // 16 * 16  # the first prompt's full blocks; the text so far is prefilled
        assert _one(await _samples(http, sim), "vllm:prefix_cache_hits_total") == chat_hit

        document = "Another document, continued as a completion. " * 60
        status, first = await post("/v1/completions", {"prompt": document})
        assert status == 200
        status, second = await post("/v1/completions", {"prompt": document + first["choices"][0]["text"]})
        assert status == 200
        assert _one(await _samples(http, sim), "vllm:prefix_cache_hits_total") == chat_hit + len(document) // 4 // 16 * 16
