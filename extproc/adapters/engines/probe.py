"""One look at whether an engine process is there, sooner than the next scrape would tell.

Two questions need it:

* a request to the endpoint ended, and its slot waits for a sign of life
  before it is refilled (``core/release/unconfirmed.py``): an engine that
  died cut every request it served at once. That asks only whether anything
  still listens on the engine's port, after every end, so it is a TCP
  connect and close (:func:`listening`, about 0.04 ms of CPU on loopback;
  an HTTP ``GET`` costs ten times that). A port that refuses is a dead
  process: down;
* its ``/metrics`` connection was reset (``scraper.py``): a broken exporter or
  proxy in front of a live engine, or an engine going away. That asks
  whether the engine serves, rarely (once a failed scrape), so it is ``GET``
  on the dialect's health path (``/health`` for every engine we read) over
  a new connection (:func:`probe`): a reused keep-alive connection to a
  killed engine fails with a reset that would say nothing. Nothing
  listening, or a reset before an answer, is *unreachable*; an HTTP answer
  of 2xx–4xx shows the process alive (a 404 is a server without that
  route, still serving); a 5xx (vLLM's dead engine core, llama.cpp loading
  its model) or no answer in time says nothing either way.

:class:`Prober` keeps at most one look in flight per endpoint, and looks
again while ends newer than its last look wait; a look counts only for the ends
at least ``SETTLE_S`` before it.
"""

from __future__ import annotations

import asyncio
import time
from enum import Enum
from urllib.parse import urlsplit

import aiohttp

from extproc.adapters.config import ModelConfig
from extproc.core.dispatcher import ModelDispatcher

# A killed engine's port still accepts connections for about 2 ms after its requests were cut
# (measured on the simulator): a connect sooner after an end than this would find a dying process
# "alive" and refill its slot into it. The slot waits this much longer; the engine meanwhile runs
# what it holds and what waits in it.
SETTLE_S = 0.02


class ProbeResult(Enum):
    ALIVE = "alive"
    UNREACHABLE = "unreachable"
    UNKNOWN = "unknown"


async def probe(session: aiohttp.ClientSession, url: str, timeout_s: float) -> ProbeResult:
    """What one ``GET url`` on a fresh connection of ``session`` (``force_close``) says of the engine."""
    try:
        async with asyncio.timeout(timeout_s), session.get(url) as response:
            return ProbeResult.UNKNOWN if response.status >= 500 else ProbeResult.ALIVE
    except TimeoutError:
        return ProbeResult.UNKNOWN
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
        return ProbeResult.UNREACHABLE  # refused, reset, closed before an answer: nothing serves there
    except aiohttp.ClientError:
        return ProbeResult.UNKNOWN


async def listening(endpoint: str, timeout_s: float) -> ProbeResult:
    """Whether anything accepts a TCP connection at ``endpoint``'s host and port (closed at once)."""
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        async with asyncio.timeout(timeout_s):
            transport, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, parts.hostname or "", port)
    except TimeoutError:
        return ProbeResult.UNKNOWN
    except OSError:
        return ProbeResult.UNREACHABLE  # refused, reset, no route: nothing serves there
    transport.close()
    return ProbeResult.ALIVE


def probe_session() -> aiohttp.ClientSession:
    """A session whose every request opens its own connection (a refusal then means the port is dead)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


class Prober:
    """Looks at ``model``'s endpoints (:func:`listening`) when its dispatcher asks, and tells it the answers."""

    def __init__(self, model: ModelConfig, dispatcher: ModelDispatcher) -> None:
        self._model = model
        self._dispatcher = dispatcher
        self._running: dict[str, asyncio.Task[None]] = {}

    def __call__(self, endpoints: tuple[str, ...]) -> None:
        """Probe each of ``endpoints`` soon (one probe in flight per endpoint; a newer end gets a newer probe)."""
        for endpoint in endpoints:
            if endpoint not in self._running:
                self._running[endpoint] = asyncio.create_task(self._probe(endpoint))

    async def _probe(self, endpoint: str) -> None:
        try:
            while self._dispatcher.awaits_life(endpoint):
                await asyncio.sleep(SETTLE_S)
                started = time.monotonic()
                answer = await listening(endpoint, self._model.advanced.stale_after_s)
                if answer is ProbeResult.UNKNOWN:
                    await asyncio.sleep(self._model.advanced.scrape_interval_s)  # a scrape may settle it meanwhile
                    continue
                # A port that still accepts shows life only for the ends at least SETTLE_S before the look.
                self._dispatcher.record_probe(endpoint, answer is ProbeResult.ALIVE, started - SETTLE_S)
                if answer is ProbeResult.UNREACHABLE:
                    break
        finally:
            self._running.pop(endpoint, None)

    async def close(self) -> None:
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
