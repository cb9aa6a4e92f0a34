"""A model pool's members: the configured endpoints, with host names resolved periodically.

An endpoint given by IP address is one member. An endpoint given by host name
(a Kubernetes headless service, a round-robin DNS name) stands for every
address it resolves to: each is scraped and gated as its own member, as
Envoy's STRICT_DNS cluster balances over the same addresses. The name is
resolved every ``dns_refresh_s``; a failed lookup keeps the last known
addresses (and, before the first success, the name itself as one member, so a
pool is never empty and traffic never stops).

:func:`watch_pool` keeps one scrape task per member running, and probes a
member when a request to it ended (``probe.py``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from urllib.parse import urlsplit

import aiohttp

from extproc.adapters.config import ModelConfig, is_ip_address
from extproc.adapters.engines.probe import Prober
from extproc.adapters.engines.scraper import scrape_endpoint
from extproc.core.dispatcher import ModelDispatcher

log = logging.getLogger(__name__)


def _url(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"


async def resolve(endpoint: str) -> list[str]:
    """The member URLs for one configured endpoint (itself if it is an address)."""
    parts = urlsplit(endpoint)
    host, port = parts.hostname or "", parts.port or 0
    if is_ip_address(host):
        return [endpoint]
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({_url(parts.scheme, str(info[4][0]), port) for info in infos})


async def _members(configured: tuple[str, ...], previous: dict[str, list[str]]) -> dict[str, list[str]]:
    result: dict[str, list[str]] = {}
    for endpoint in configured:
        try:
            result[endpoint] = await resolve(endpoint) or previous[endpoint]
        except OSError as exc:
            log.warning("cannot resolve %s (%s); keeping %s", endpoint, exc, previous[endpoint])
            result[endpoint] = previous[endpoint]
    return result


async def watch_pool(session: aiohttp.ClientSession, probes: aiohttp.ClientSession, model: ModelConfig,
                     dispatcher: ModelDispatcher) -> None:
    """Scrape every member of ``model``'s pool, re-resolving host names, until cancelled.

    ``probes`` is a :func:`~.probe.probe_session`. Both sessions are the caller's, closed by it: a
    scraper cancelled twice (a reload's drain, then a shutdown) would cut short its own cleanup.
    """
    resolved = {e: [e] for e in model.endpoints}
    tasks: dict[str, asyncio.Task[None]] = {}
    needs_dns = not all(is_ip_address(urlsplit(e).hostname or "") for e in model.endpoints)
    prober = Prober(model, dispatcher)
    dispatcher.probe_with(prober)
    try:
        while True:
            resolved = await _members(model.endpoints, resolved)
            members = tuple(dict.fromkeys(url for urls in resolved.values() for url in urls))
            if set(members) != set(tasks):
                if tasks:
                    log.info("model %s: pool is now %s", model.name, ", ".join(members))
                for gone in set(tasks) - set(members):
                    tasks.pop(gone).cancel()
                dispatcher.set_endpoints(members)
                for new in members:
                    if new not in tasks:
                        tasks[new] = asyncio.create_task(scrape_endpoint(session, model, dispatcher, new, probes))
            if not needs_dns:
                await asyncio.Event().wait()  # a static pool: nothing to refresh
            await asyncio.sleep(model.dns_refresh_s)
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await prober.close()
