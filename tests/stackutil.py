"""Helpers for tests that run the real stack: configs on free ports, metric reads."""

from __future__ import annotations

import asyncio
import string
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from extproc.tools.power_user import Outcome, chat
from extproc.tools.procs import free_port
from extproc.tools.stack import Stack

API_KEYS = {"key-alice": "alice", "key-bob": "bob", "key-carol": "carol", "key-dave": "dave"}
TENANT_KEYS = {tenant: key for key, tenant in API_KEYS.items()}

T = TypeVar("T")


def send_chat(
    session: aiohttp.ClientSession, stack: Stack, tenant: str, max_tokens: int, model: str = "m1"
) -> asyncio.Task[Outcome]:
    """One streaming chat from ``tenant`` (with its test key) through the stack's Envoy, as a task."""
    return asyncio.create_task(
        chat(session, stack.envoy_url, tenant, model, api_key=TENANT_KEYS[tenant], max_tokens=max_tokens)
    )


def write_config(
    tmp_path: Path, models: tuple[str, ...] = ("m1",), replicas: int = 1, per_model: dict[str, dict[str, Any]] | None = None,
    **model_overrides: Any,
) -> Path:
    """A config on free ports, ``replicas`` simulator endpoints per model.

    ``per_model`` adds settings to single models (e.g. their ``engine``).
    """
    doc = {
        "listen": {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"},
        "priorities": ["interactive", "standard", "batch"],
        "default_priority": "standard",
        "models": [
            {
                "name": name,
                "endpoints": [f"http://127.0.0.1:{free_port()}" for _ in range(replicas)],
                **model_overrides,
                **(per_model or {}).get(name, {}),
            }
            for name in models
        ],
        "envoy": {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}", "api_keys": API_KEYS},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


async def read_metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus page, keyed by (name, sorted labels)."""
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        text = await response.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def poll(read: Callable[[], Awaitable[T]], done: Callable[[T], bool], timeout_s: float = 20) -> T:
    """``read()`` every 50 ms until ``done(value)`` or the deadline; returns the last value for the assertion.

    The deadline is on the clock, not a count of reads: a read slowed by a loaded machine does not stretch it.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = await read()
        if done(value) or loop.time() >= deadline:
            return value
        await asyncio.sleep(0.05)


async def wait_for_metric(
    url: str, name: str, done: Callable[[float], bool], timeout_s: float = 20, **labels: str
) -> float:
    """Poll a metric until ``done(value)`` or the timeout; returns the last value for the assertion."""

    async def read() -> float:
        return metric(await read_metrics(url), name, **labels)

    return await poll(read, done, timeout_s)


def metric(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(
        (value for (n, lbls), value in samples.items() if n == name and all(dict(lbls).get(k) == v for k, v in labels.items())),
        0.0,
    )


def write_stack_config(
    tmp_path: Path, models: dict[str, dict[str, Any]], *, api_keys: dict[str, str] | None = None,
    redis_url: str | None = None, cluster_instances: int = 0, **top: Any,
) -> Path:
    """A config on free ports: one simulator endpoint per model, each with its own settings.

    ``top`` adds or replaces top-level sections (tenants, bands, identity, ...);
    ``api_keys=None`` means the test keys, ``{}`` none. ``redis_url`` adds a
    ``cluster:`` section (active-active) with ``cluster_instances`` instances
    named a, b, c, ... on free ports (``start_stack`` starts one processor
    each); ``top``'s ``listen``, ``envoy`` and ``cluster`` are merged into the
    generated sections (e.g. ``cluster={"lease_s": 1.0}``, or TLS on the
    processor's port: ``listen={"tls": ...}`` with the ``envoy`` keys of
    ``tests.tlsutil.processor_tls``).
    """
    envoy: dict[str, Any] = {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}"}
    keys = API_KEYS if api_keys is None else api_keys
    if keys:
        envoy["api_keys"] = keys
    doc: dict[str, Any] = {
        "listen": {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"},
        "priorities": ["interactive", "standard", "batch"],
        "default_priority": "standard",
        "models": [
            {"name": name, "endpoints": [f"http://127.0.0.1:{free_port()}"], **settings}
            for name, settings in models.items()
        ],
        "envoy": envoy,
    }
    if cluster_instances and redis_url is None:
        raise ValueError("cluster_instances needs a redis_url (the redis_server fixture's .url)")
    if redis_url is not None:
        doc["cluster"] = {"redis_url": redis_url}
        if cluster_instances:
            doc["cluster"]["instances"] = {
                string.ascii_lowercase[i]: {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"}
                for i in range(cluster_instances)
            }
    for key, value in top.items():
        if key in ("listen", "envoy", "cluster") and key in doc:
            doc[key].update(value)
        else:
            doc[key] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path
