"""Polls each engine endpoint's ``/metrics`` and feeds the result to its dispatcher.

One task per endpoint, on a fixed period measured from the start of each
scrape. A scrape that fails, times out or returns text the reader rejects is
reported as "no load" — the gate then falls back to its conservative limit —
and logged once when an endpoint turns bad and once when it recovers, not on
every attempt. A refused connection (nothing listens: the engine process is
gone) is reported as unreachable: the gate marks the endpoint down and
releases nothing to it. A connection reset or dropped mid-answer may be the
engine going away, or only its metrics (a broken exporter, a proxy in front
of it): the engine's health endpoint is probed on a fresh connection
(``probe.py``) before it is called down, and while that answers the engine
serves on the fallback. An HTTP error, a garbage page or a slow answer means
the engine lives and may serve, so traffic keeps flowing on the fallback.

Once an endpoint answers (and again after it was unreachable) what its engine
says of its own limits is read from its info endpoint (``limits.py``).

A member given by host name is a name that has no address now
(``discovery.py``): it is reported unreachable at each interval without a
request (no lookup at the scrape's pace, and never a release to a name),
until discovery replaces it with the addresses it resolves to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

import aiohttp

from extproc.adapters.config import ModelConfig, is_ip_address
from extproc.adapters.engines.limits import read_limits
from extproc.adapters.engines.probe import ProbeResult, probe
from extproc.adapters.protocol.dialects import DIALECTS, MetricsError, parse_load
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.values.engine_load import EngineLoad

log = logging.getLogger(__name__)


async def _scrape_once(session: aiohttp.ClientSession, url: str, engine: str, model: str) -> EngineLoad:
    async with session.get(url) as response:
        if response.status != 200:
            raise MetricsError(f"HTTP {response.status}")
        return parse_load(engine, await response.text(), model)


async def scrape_endpoint(
    session: aiohttp.ClientSession, model: ModelConfig, dispatcher: ModelDispatcher, endpoint: str,
    probes: aiohttp.ClientSession,
) -> None:
    """Scrape ``endpoint`` of ``model``'s pool forever (until cancelled); ``probes`` opens a connection per request."""
    url = f"{endpoint}/metrics"
    # A scrape slower than the staleness limit is useless: give up on it then.
    healthy: bool | None = None
    # What the engine says of its own limits is read once it answers, and again after it was gone.
    limits_read = False
    unresolved = not is_ip_address(urlsplit(endpoint).hostname or "")
    while True:
        started = time.monotonic()
        if unresolved:
            dispatcher.record_scrape(endpoint, None, started, reachable=False)
            await asyncio.sleep(model.advanced.scrape_interval_s)
            continue
        reachable = True
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result of a scrape that
            # finished as the task was cancelled, losing the cancel (a shutdown then waited forever).
            async with asyncio.timeout(model.advanced.stale_after_s):
                load: EngineLoad | None = await _scrape_once(session, url, model.engine, model.name)
        except (TimeoutError, aiohttp.ClientError, MetricsError, UnicodeDecodeError) as exc:
            load = None
            # Refused (or the name does not resolve): nothing listens, the engine is gone.
            # Reset or dropped mid-answer: gone, or only its metrics broken; its health says
            # which. A connect timeout is left to the overall one: a busy host may be slow
            # to accept and still serve.
            if isinstance(exc, aiohttp.ClientConnectorError):
                reachable = False
            elif isinstance(exc, aiohttp.ClientOSError | aiohttp.ServerDisconnectedError):
                answer = await probe(probes, endpoint + DIALECTS[model.engine].health_path, model.advanced.stale_after_s)
                reachable = answer is not ProbeResult.UNREACHABLE
                if answer is ProbeResult.ALIVE:
                    dispatcher.record_probe(endpoint, True, started)
            if healthy is not False:
                log.warning("model %s: cannot read %s: %s%s", model.name, url, exc or type(exc).__name__,
                            "" if reachable else " (the engine does not answer)")
        else:
            if healthy is False:
                log.info("model %s: %s readable again", model.name, url)
        healthy = load is not None
        dispatcher.record_scrape(endpoint, load, started, reachable=reachable)
        if not reachable:
            limits_read = False
        elif load is not None and not limits_read:
            limits_read = True
            limits = await read_limits(session, endpoint, model.engine, model.name, model.advanced.stale_after_s)
            if limits is not None:
                dispatcher.record_limits(endpoint, limits)
        await asyncio.sleep(max(0.0, model.advanced.scrape_interval_s - (time.monotonic() - started)))
