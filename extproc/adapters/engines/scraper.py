"""Polls each engine endpoint's ``/metrics`` and feeds the result to its dispatcher.

One task per endpoint, on a fixed period measured from the start of each
scrape. A scrape that fails, times out or returns text the reader rejects is
reported as "no load" — the gate then falls back to its conservative limit —
and logged once when an endpoint turns bad and once when it recovers, not on
every attempt. A refused or dropped connection (nothing listens: the engine
process is gone) is reported as unreachable: the gate marks the endpoint down and
releases nothing to it. An HTTP error, a garbage page or a slow answer means
the engine lives and may serve, so traffic keeps flowing on the fallback.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from extproc.adapters.config import ModelConfig
from extproc.adapters.engines.dialects import MetricsError, parse_load
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.engine_load import EngineLoad

log = logging.getLogger(__name__)


async def _scrape_once(session: aiohttp.ClientSession, url: str, engine: str, model: str) -> EngineLoad:
    async with session.get(url) as response:
        if response.status != 200:
            raise MetricsError(f"HTTP {response.status}")
        return parse_load(engine, await response.text(), model)


async def scrape_endpoint(
    session: aiohttp.ClientSession, model: ModelConfig, dispatcher: ModelDispatcher, endpoint: str
) -> None:
    """Scrape ``endpoint`` of ``model``'s pool forever (until cancelled)."""
    url = f"{endpoint}/metrics"
    # A scrape slower than the staleness limit is useless: give up on it then.
    healthy: bool | None = None
    while True:
        started = time.monotonic()
        reachable = True
        try:
            load: EngineLoad | None = await asyncio.wait_for(
                _scrape_once(session, url, model.engine, model.name), model.stale_after_s
            )
        except (TimeoutError, aiohttp.ClientError, MetricsError, UnicodeDecodeError) as exc:
            load = None
            # Refused or reset (ClientOSError; the name does not resolve), or the connection
            # dropped mid-answer: the engine process is gone or going. A connect timeout is
            # left to the overall one: a busy host may be slow to accept and still serve.
            reachable = not isinstance(exc, aiohttp.ClientOSError | aiohttp.ServerDisconnectedError)
            if healthy is not False:
                log.warning("model %s: cannot read %s: %s", model.name, url, exc or type(exc).__name__)
        else:
            if healthy is False:
                log.info("model %s: %s readable again", model.name, url)
        healthy = load is not None
        dispatcher.record_scrape(endpoint, load, started, reachable=reachable)
        await asyncio.sleep(max(0.0, model.scrape_interval_s - (time.monotonic() - started)))
