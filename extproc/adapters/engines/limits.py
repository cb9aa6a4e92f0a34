"""What each engine says of its own limits, from its own info endpoint, once per endpoint.

Read when an endpoint first answers a scrape, and again after it was
unreachable (a restarted engine may have new arguments), by the scraper
(``scraper.py``); the core bounds its limit with them and warns when the
engine's queue cap is below what the gate sends (``EngineLimits.too_tight``).
Which engine says what (checked against each project's source; the table in
docs/engines.md):

* vLLM (0.32): ``GET /v1/models`` has the model's ``max_model_len``, nothing
  else: ``max_num_seqs``, the queue caps and the scheduling policy are only in
  ``/server_info`` (``vllm_config.scheduler_config``), which exists with
  ``VLLM_SERVER_DEV_MODE`` alone; it is read where it answers. Its refusals
  are read from ``vllm:admission_rejections_total`` instead (dialects.py).
* SGLang: ``GET /server_info`` dumps its server arguments:
  ``max_running_requests``, ``max_queued_requests`` (waiting only: the cap on
  what it holds is their sum), ``context_length``, and whether it orders its
  queue by priority (``enable_priority_scheduling``; lower values first with
  ``schedule_low_priority_values_first``, else higher).
* TGI: ``GET /info``: ``max_concurrent_requests`` (running and queued),
  ``max_total_tokens``.
* llama.cpp: ``GET /props``: ``total_slots`` and the context's ``n_ctx``; it
  has no queue cap (requests wait without bound).
* TensorRT-LLM: nothing read.

An endpoint that does not answer, or answers something else, says nothing:
the gate learns from the engine's metrics as before.
"""

from __future__ import annotations

import json
from asyncio import timeout as asyncio_timeout
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from extproc.core.values.engine_load import EngineLimits


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _vllm(doc: Mapping[str, Any], model: str) -> EngineLimits:
    cards = [c for c in doc.get("data", []) if isinstance(c, dict)]
    card = next((c for c in cards if c.get("id") == model), cards[0] if len(cards) == 1 else {})
    return EngineLimits(max_model_len=_int(card.get("max_model_len")))


def _vllm_config(doc: Mapping[str, Any], model: str) -> EngineLimits:
    """vLLM's ``/server_info?config_format=json`` (development mode only): its scheduler's batch and queue order."""
    config = doc.get("vllm_config")
    scheduler = config.get("scheduler_config") if isinstance(config, dict) else None
    if not isinstance(scheduler, dict):
        return EngineLimits()
    return EngineLimits(max_running=_int(scheduler.get("max_num_seqs")),
                        priority_first="lower" if scheduler.get("policy") == "priority" else None)


def _sglang(doc: Mapping[str, Any], model: str) -> EngineLimits:
    running, queued = _int(doc.get("max_running_requests")), _int(doc.get("max_queued_requests"))
    ordered = doc.get("enable_priority_scheduling") is True
    return EngineLimits(
        max_running=running,
        max_held=running + queued if running is not None and queued is not None else None,
        max_model_len=_int(doc.get("context_length")),
        priority_first=None if not ordered else "lower" if doc.get("schedule_low_priority_values_first") else "higher",
    )


def _tgi(doc: Mapping[str, Any], model: str) -> EngineLimits:
    return EngineLimits(max_held=_int(doc.get("max_concurrent_requests")), max_model_len=_int(doc.get("max_total_tokens")))


def _llamacpp(doc: Mapping[str, Any], model: str) -> EngineLimits:
    settings = doc.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    return EngineLimits(max_running=_int(doc.get("total_slots")), max_model_len=_int(n_ctx))


# Each engine's own queue cap, and the line the gate needs it above ({t}: target_waiting). Said by
# `extproc serve` at start (check-config cannot see the engine); docs/engines.md has the reasons.
_CAPS = {
    "vllm": "its own queue cap is off by default; if you set --max-num-queued-reqs (waiting + running), make it "
            "at least --max-num-seqs + {t} plus the most requests that reach vLLM without the gateway, and "
            "--max-num-queued-tokens at least {t} + --max-num-seqs of your longest prompts: below that vLLM refuses "
            "requests the gateway released (Envoy retries a 503; a stream refused while others arrive gets a 200 "
            "with the error inside, which nothing can retry)",
    "sglang": "if you set --max-queued-requests (waiting only), make it at least {t} plus the most requests that "
              "reach SGLang without the gateway: below that it refuses requests the gateway released",
    "tgi": "--max-concurrent-requests (running + queued, default 128) must be at least its batch + {t} plus the "
           "most requests that reach TGI without the gateway: below that it refuses requests the gateway released",
    "llamacpp": "it has no queue cap (requests beyond its slots wait in it): nothing to set",
    "trtllm": "the gateway reads no queue cap of it: keep any cap you set above its batch + {t}",
}


def cap_advice(engine: str, target_waiting: int) -> str:
    """What to set the engine's own queue cap to, beside the gateway's ``target_waiting``."""
    return _CAPS[engine].format(t=target_waiting)


@dataclass(frozen=True)
class LimitsSource:
    """Where an engine says its limits, and how to read its JSON answer for one model."""

    path: str
    read: Callable[[Mapping[str, Any], str], EngineLimits]


# Per engine, the places read in turn; what a later one says fills what the earlier ones did not.
SOURCES: dict[str, tuple[LimitsSource, ...]] = {
    "vllm": (LimitsSource("/v1/models", _vllm), LimitsSource("/server_info?config_format=json", _vllm_config)),
    "sglang": (LimitsSource("/server_info", _sglang),),
    "tgi": (LimitsSource("/info", _tgi),),
    "llamacpp": (LimitsSource("/props", _llamacpp),),
}


async def read_limits(session: aiohttp.ClientSession, endpoint: str, engine: str, model: str,
                      timeout_s: float) -> EngineLimits | None:
    """What ``endpoint`` says of its limits; None when its engine has no such endpoint or it does not answer."""
    said = [limits for source in SOURCES.get(engine, ())
            if (limits := await _read(session, endpoint + source.path, source, model, timeout_s)) is not None]
    if not said:
        return None
    merged = {key: next((value for limits in said if (value := getattr(limits, key)) is not None), None)
              for key in vars(said[0])}
    return EngineLimits(**merged)


async def _read(session: aiohttp.ClientSession, url: str, source: LimitsSource, model: str,
                timeout_s: float) -> EngineLimits | None:
    try:
        async with asyncio_timeout(timeout_s), session.get(url) as response:
            if response.status != 200:
                return None
            doc = json.loads(await response.read())
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None
    return source.read(doc, model) if isinstance(doc, dict) else None
