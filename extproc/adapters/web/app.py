"""The metrics port: an aiohttp app on the processor's event loop.

Routes, and why each exists:

* ``/metrics``: the Prometheus page (OpenMetrics when the scraper asks for
  it), rendered in a worker thread as prometheus_client's own server did, so
  a large page does not stall held requests.
* ``/healthz``: the process answers (liveness). Nothing else: a process that
  waits for an engine is alive, and restarting it would drop its queue.
* ``/readyz``: ready to schedule (readiness): the config is loaded (it is,
  once this answers), every model whose gate reads metrics has had a usable scrape of one endpoint since start,
  or has no engine up (a pool scaled to zero: its requests are held for the cold start; a model a reload added or
  rebuilt is not waited for), and the processor is not draining. 503 with the reasons otherwise, so a
  probe does not send traffic to a processor that is leaving. Either answer carries ``warnings``: engine
  settings the operator should fix (a queue cap below what the gate sends), which do not make it unready.
* ``/`` and ``/status.json``: the live status page (``status.html``), which
  polls the JSON. The JSON is built on request from the dispatchers' state
  (``core/values/status.py``); the hot path does no work for it. Each model's
  ``objectives`` (met, missed, preempted per class and tenant, the last
  minute's slack at release) come from its telemetry, which keeps them as it
  counts them (``adapters/telemetry/objectives.py``). With ``batches:``, the batch
  API's batches in progress (``adapters/batches``), read from its store.
* ``/usage``: with tenant budgets, what each tenant used per model and day or
  month, as CSV or JSON (``adapters/budgets/usage.py``), for finance.

With a cluster, the budgets' counts are in Redis: ``refresh`` reads them
before ``/metrics`` and ``/status.json`` are built (at most once a second,
``adapters/budgets/cluster_standings.py``), never on a request's path.

Anything else is 404 with the OpenAI-style error body and ``x-extproc-reason``,
as the processor's other answers, so an HTTP probe of a wrong path fails
rather than looking healthy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict
from importlib import resources
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from extproc.adapters.protocol.answers import ANSWERS, answer_headers, error_body, retry_after_s
from extproc.adapters.telemetry import Telemetry
from extproc.adapters.telemetry.objectives import ObjectivesStatus
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.values.outcomes import Refusal
from extproc.core.values.status import ModelStatus

if TYPE_CHECKING:
    from extproc.adapters.budgets.usage import Per

# Tenants listed per priority class on the status page; the rest are summed.
TOP_TENANTS = 10
PAGE = resources.files(__package__).joinpath("status.html").read_bytes()


def error(refusal: Refusal, message: str) -> web.Response:
    """The OpenAI-style JSON error, as the processor's and Envoy's own answers (adapters/protocol/answers.py)."""
    return web.json_response(error_body(refusal, message), status=ANSWERS[refusal].status,
                             headers=dict(answer_headers(refusal, retry_after_s(refusal))))


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The usage export from a day (YYYY-MM-DD), per day or month: records, or None without budgets.
UsageSource = Callable[[str, "Per"], Awaitable[list[dict[str, Any]] | None]]


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own 404 and 405 as JSON errors."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return error(Refusal.NOT_FOUND, f"no such path: {request.path}; try /, /metrics, /healthz, /readyz, /status.json")
    except web.HTTPMethodNotAllowed as exc:
        return error(Refusal.METHOD_NOT_ALLOWED, f"{exc.method} is not allowed on {request.path}")


def not_ready(statuses: list[ModelStatus], draining: bool) -> list[str]:
    """Why the processor is not ready (empty: ready)."""
    reasons = [f"model {s.name!r}: no usable scrape of any endpoint yet" for s in statuses if not s.known]
    if draining:
        reasons.append("draining: the processor is shutting down")
    return reasons


def warnings(statuses: list[ModelStatus]) -> list[str]:
    """What the operator should fix about the engines' own settings: ready all the same, but told."""
    return [f"model {s.name!r}: {e.url}: {e.warning}" for s in statuses for e in s.endpoints if e.warning]


def status_document(statuses: list[ModelStatus], draining: bool,
                    objectives: Mapping[str, ObjectivesStatus] | None = None,
                    budgets: list[dict[str, object]] | None = None,
                    batches: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """What /status.json answers; each model with its ``objectives`` where ``objectives`` has them (else null).

    ``budgets``: the named tenants' and groups' limits as they stand (null without a budgets: section).
    ``batches``: the batch API's batches in progress (null without ``batches:``).
    """
    found = objectives or {}
    models = [{**asdict(s), "objectives": asdict(found[s.name]) if s.name in found else None} for s in statuses]
    return {"draining": draining, "not_ready": not_ready(statuses, draining), "top_tenants": TOP_TENANTS,
            "models": models, "budgets": budgets, "batches": batches}


def build_app(registry: CollectorRegistry, dispatchers: Mapping[str, ModelDispatcher],
              draining: Callable[[], bool], telemetry: Telemetry | None = None,
              awaited: Callable[[str], bool] = lambda model: True, usage: UsageSource | None = None,
              budgets: Callable[[], list[dict[str, object]] | None] = lambda: None,
              batches: Callable[[], list[dict[str, Any]]] | None = None,
              refresh: Callable[[], Awaitable[None]] | None = None) -> web.Application:
    """The app; ``draining`` tells whether the processor is shutting down; ``telemetry``, the objectives' numbers.

    ``awaited``: whether readiness waits for a model's first scrape (not for
    one a reload added: a serving processor does not turn unready for it).
    ``usage``: the budgets' usage export (None, or answering None: no budgets); ``budgets``: their limits now.
    ``batches``: the batch API's batches in progress, for the status page.
    ``refresh``: awaited before the metrics and the status are read (the budgets' counts in a cluster's Redis).
    """

    def statuses() -> list[ModelStatus]:
        return [d.status(TOP_TENANTS) for d in dispatchers.values()]

    def objectives() -> dict[str, ObjectivesStatus]:
        models = {} if telemetry is None else telemetry.models
        return {name: models[name].objectives.status(TOP_TENANTS) for name in dispatchers if name in models}

    async def metrics(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        if refresh is not None:
            await refresh()
        body = await asyncio.to_thread(encoder, registry)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def readyz(request: web.Request) -> web.Response:
        now = statuses()
        reasons, told = not_ready([s for s in now if awaited(s.name)], draining()), warnings(now)
        if reasons:
            return error(Refusal.NOT_READY, "; ".join(reasons + told))
        return web.json_response({"status": "ready", **({"warnings": told} if told else {})})

    async def status_json(request: web.Request) -> web.Response:
        if refresh is not None:
            await refresh()
        return web.json_response(status_document(statuses(), draining(), objectives(), budgets(),
                                                 None if batches is None else batches()),
                                 headers={"Cache-Control": "no-store"})

    async def page(request: web.Request) -> web.Response:
        return web.Response(body=PAGE, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def usage_export(request: web.Request) -> web.Response:
        # The export's format (adapters/budgets/usage.py), loaded when first asked for: budgets are optional.
        from extproc.adapters.budgets.usage import Unavailable, render, since_day

        query = request.query
        form, per = query.get("format", "json"), query.get("per", "day")
        try:
            since = since_day(query.get("since", "1970-01-01"))
            if form not in ("csv", "json") or per not in ("day", "month"):
                raise ValueError("format must be csv or json, per day or month")
        except ValueError as exc:
            return error(Refusal.BAD_REQUEST, str(exc))
        try:
            found = None if usage is None else await usage(since, "day" if per == "day" else "month")
        except Unavailable as exc:
            return error(Refusal.GATEWAY_ERROR, str(exc))
        if found is None:
            return error(Refusal.NOT_FOUND, "no usage: the config has no budgets: section")
        return web.Response(text=render(found, "csv" if form == "csv" else "json"),
                            content_type="text/csv" if form == "csv" else "application/json",
                            headers={"Cache-Control": "no-store"})

    app = web.Application(middlewares=[json_errors])
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status.json", status_json)
    app.router.add_get("/usage", usage_export)
    app.router.add_get("/", page)
    return app


class MetricsServer:
    """The app bound to the metrics address; ``start`` raises OSError when it cannot bind."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        self._host, self._port = host, port

    async def start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, self._host or None, self._port, reuse_address=True).start()

    async def stop(self) -> None:
        await self._runner.cleanup()
