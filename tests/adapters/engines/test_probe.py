"""What a probe of an engine's /health says, and what the scraper and the prober make of it, over real HTTP.

An engine on loopback (aiohttp) whose /metrics and /health are made to
answer, fail, reset or not listen at all; a real dispatcher on the other
side (``adapters/engines/probe.py``, ``scraper.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from extproc.adapters.config import Config, load_config
from extproc.adapters.engines.probe import Prober, ProbeResult, listening, probe, probe_session
from extproc.adapters.engines.scraper import scrape_endpoint
from extproc.adapters.timers import LoopTimers
from extproc.core.bands import Band
from extproc.core.cost import CostWeights
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.entitlement import Tenant
from extproc.core.policies import POLICIES
from extproc.core.release.pool import Pool
from extproc.core.values.report import Change, DispatchReport, EndpointEvent
from extproc.tools.procs import free_port
from tests.helpers.gate import make_gate
from tests.httputil import serving
from tests.waitutil import eventually

pytestmark = pytest.mark.integration

PAGE = 'vllm:num_requests_running{model_name="m1"} 0\nvllm:num_requests_waiting{model_name="m1"} 0\n'
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _reset(request: web.Request) -> web.StreamResponse:
    assert request.transport is not None
    request.transport.abort()
    return web.Response()


async def _page(_: web.Request) -> web.StreamResponse:
    return web.Response(text=PAGE)


def _status(code: int) -> Handler:
    async def answer(_: web.Request) -> web.StreamResponse:
        return web.Response(status=code)

    return answer


def engine(metrics: Handler, health: Handler) -> AbstractAsyncContextManager[str]:
    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return serving(app)


def _config(endpoint: str, tmp_path: Path) -> Config:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "m1", "endpoints": [endpoint]}]}))
    return load_config(path)


def _dispatcher(endpoint: str, report: DispatchReport = lambda _: None) -> tuple[ModelDispatcher, Pool]:
    pool = make_gate(endpoints=(endpoint,), kind="static_concurrency", max_in_flight=1)
    return ModelDispatcher(
        "m1", pool, (Band("standard", 60.0),),
        report, policy=POLICIES["round_robin"],
        tenant=lambda _: Tenant(("standard",), "standard", weight=1.0, max_queued=100),
        cost=CostWeights(), max_queued=100, max_queue_wait_s=60.0, reserved_waiting=0, timers=LoopTimers(),
    ), pool


@pytest.mark.parametrize(("health", "expected"), [
    (_status(200), ProbeResult.ALIVE), (_status(404), ProbeResult.ALIVE), (_status(503), ProbeResult.UNKNOWN),
    (_reset, ProbeResult.UNREACHABLE),
], ids=["200", "404", "503", "reset"])
async def test_a_probe_tells_a_live_process_from_one_that_does_not_answer(health: Handler, expected: ProbeResult) -> None:
    async with engine(_page, health) as url, probe_session() as session:
        assert await probe(session, url + "/health", 1.0) is expected


async def test_a_port_nothing_listens_on_is_unreachable_to_either_look() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with probe_session() as session:
        assert await probe(session, url + "/health", 1.0) is ProbeResult.UNREACHABLE
    assert await listening(url, 1.0) is ProbeResult.UNREACHABLE


async def test_a_port_that_accepts_is_alive_to_the_cheap_look() -> None:
    async with engine(_reset, _reset) as url:
        assert await listening(url, 1.0) is ProbeResult.ALIVE


@pytest.mark.parametrize(("health", "down"), [(_status(200), False), (_reset, True)], ids=["health-answers", "health-resets"])
async def test_a_reset_metrics_connection_is_down_only_when_the_engine_does_not_answer_either(
    tmp_path: Path, health: Handler, down: bool
) -> None:
    async with engine(_reset, health) as url, aiohttp.ClientSession() as session, probe_session() as probes:
        model = _config(url, tmp_path).models[0]
        failed: list[EndpointEvent] = []

        def report(event: object) -> None:
            if isinstance(event, EndpointEvent) and event.change is Change.SCRAPE_FAILED:
                failed.append(event)

        dispatcher, pool = _dispatcher(url, report)
        task = asyncio.create_task(scrape_endpoint(session, model, dispatcher, url, probes))
        # The first failed scrape (its probe included) decides both; the next ones must not change that.
        await eventually(lambda: len(failed) >= 3, what="3 failed scrapes")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert pool.down() == ([url] if down else [])
    assert pool.unusable_metrics(0.0) == (url,)  # either way its metrics cannot be used


async def test_an_end_is_probed_and_its_slot_freed_when_the_engine_answers(tmp_path: Path) -> None:
    async with engine(_page, _status(200)) as url:
        dispatcher, _ = _dispatcher(url)
        prober = Prober(_config(url, tmp_path).models[0], dispatcher)
        dispatcher.probe_with(prober)
        first, second = dispatcher.submit("alice", 0), dispatcher.submit("alice", 0)
        assert first.future.done() and not second.future.done()
        dispatcher.end(first)
        assert not second.future.done()  # its slot waits for the probe
        await asyncio.wait_for(second.future, 2.0)
        dispatcher.end(second)
        await prober.close()


async def test_an_end_whose_probe_is_refused_marks_the_engine_down(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    dispatcher, pool = _dispatcher(url)
    prober = Prober(_config(url, tmp_path).models[0], dispatcher)
    dispatcher.probe_with(prober)
    first, second = dispatcher.submit("alice", 0), dispatcher.submit("alice", 0)
    dispatcher.end(first)
    for _ in range(100):
        if pool.down():  # what the probe told it
            break
        await asyncio.sleep(0.01)
    assert pool.down() == [url] and not second.future.done()
    second.future.cancel()
    dispatcher.end(second)
    await prober.close()
