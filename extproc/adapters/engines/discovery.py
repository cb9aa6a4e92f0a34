"""A model pool's members: the configured endpoints, with host names resolved periodically.

An endpoint given by IP address is one member. An endpoint given by host name
(a Kubernetes headless service, a round-robin DNS name) stands for every
address it resolves to: each is scraped and gated as its own member, as
Envoy's STRICT_DNS cluster balances over the same addresses. The name is
resolved every ``dns_refresh_s``:

* new addresses join the pool (each starts degraded until its first scrape);
  addresses gone leave it: nothing more is released to them, their requests
  in flight finish and are counted until they end, and the other members keep
  what their gate learned;
* a name that has no address (NXDOMAIN or no record: a headless service with
  no ready pod, a deployment scaled to zero) stands for no engine: the pool
  may be empty, and its requests are held for the model's cold-start wait;
* a lookup that fails otherwise (the DNS server unreachable, a timeout) keeps
  the last known addresses (before the first success, the name itself as one
  member: the scraper reports it down without looking it up, ``scraper.py``,
  until a lookup succeeds).

:func:`watch_pool` keeps one scrape task per member running, and probes a
member when a request to it ended (``probe.py``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp

from extproc.adapters.config import ModelConfig, is_ip_address
from extproc.adapters.engines.probe import Prober
from extproc.adapters.engines.scraper import scrape_endpoint
from extproc.core.dispatcher import ModelDispatcher

log = logging.getLogger(__name__)

# getaddrinfo's answers that the name has no address (as opposed to a lookup that failed).
NO_ADDRESS = frozenset({socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)})


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
            result[endpoint] = await resolve(endpoint)
        except socket.gaierror as exc:
            if exc.errno in NO_ADDRESS:
                result[endpoint] = []  # no address: no engine (the caller logs the change)
            else:
                log.warning("cannot resolve %s (%s); keeping %s", endpoint, exc, previous[endpoint])
                result[endpoint] = previous[endpoint]
        except OSError as exc:
            log.warning("cannot resolve %s (%s); keeping %s", endpoint, exc, previous[endpoint])
            result[endpoint] = previous[endpoint]
    return result


async def watch_pool(session: aiohttp.ClientSession, probes: aiohttp.ClientSession, model: ModelConfig,
                     dispatcher: ModelDispatcher, synced: Callable[[], None] = lambda: None) -> None:
    """Scrape every member of ``model``'s pool, re-resolving host names, until cancelled.

    ``probes`` is a :func:`~.probe.probe_session`. Both sessions are the caller's, closed by it: a
    scraper cancelled twice (a reload's drain, then a shutdown) would cut short its own cleanup.
    ``synced`` is called once the pool's members are known (its first lookup done).
    """
    resolved = {e: [e] for e in model.endpoints}
    tasks: dict[str, asyncio.Task[None]] = {}
    needs_dns = not all(is_ip_address(urlsplit(e).hostname or "") for e in model.endpoints)
    prober = Prober(model, dispatcher)
    dispatcher.probe_with(prober)
    first = True
    try:
        while True:
            resolved = await _members(model.endpoints, resolved)
            members = tuple(dict.fromkeys(url for urls in resolved.values() for url in urls))
            if set(members) != set(tasks) or first:
                if tasks or not members:
                    log.info("model %s: pool is now %s", model.name,
                             ", ".join(members) or "empty (its names have no address: requests are held)")
                for gone in set(tasks) - set(members):
                    tasks.pop(gone).cancel()
                dispatcher.set_endpoints(members)
                for new in members:
                    if new not in tasks:
                        tasks[new] = asyncio.create_task(scrape_endpoint(session, model, dispatcher, new, probes))
            if first:
                first = False
                synced()
            if not needs_dns:
                await asyncio.Event().wait()  # a static pool: nothing to refresh
            await asyncio.sleep(model.dns_refresh_s)
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await prober.close()
