"""Every way Envoy can attach the processor, through a real Envoy 1.40: our metadata forwarded or not × body mode.

The rows are the two attachments (``adapters/ext_proc/attach/``): our own
metadata present, or the request read from the stream as an Endpoint Picker.
The columns are the request and response body modes the ext_proc filter
declares (``ProcessingRequest.protocol_config``): ``NONE``, ``BUFFERED``,
``FULL_DUPLEX_STREAMED``, both bodies alike, as the gateways set them.

The Envoy is the GIE gateway shape Envoy AI Gateway writes
(``tools/gie_gateway.py``'s ``strict``, ``allow_mode_override`` false), its
ext_proc filter's body modes set per column; with metadata, our own
``json_to_metadata`` filter runs in front of it and the ``extproc`` namespace
is forwarded (an Envoy Gateway that kept our drop-in's json_to_metadata
patch). Each combination either serves (whole, streamed, and held requests,
the body reaching the engine intact, no slot left counted) or, where nothing
can work, is refused at once with a JSON error and a log line that says why:
without our metadata and without the body (``NONE``) the processor has no
model to schedule; with our metadata and ``NONE``, a model with prefix
signatures asks for its body by a mode override this shape ignores.

Our own generated bootstrap, its filter's body modes changed the same way,
runs the paths that rewrite the body (``engine_priority``) and sign the
prompt (``prefix``) in each mode: the mode override those need is honoured
there (``allow_mode_override``), and ignored by Envoy in
``FULL_DUPLEX_STREAMED``, where the body comes anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from extproc.adapters.config import Config
from extproc.adapters.envoy import bootstrap
from extproc.adapters.envoy.filters import EXT_PROC_FILTER, http_filters
from extproc.adapters.protocol.contract import METADATA_NAMESPACE
from extproc.tools import gie_gateway
from extproc.tools.envoy_proc import start_envoy
from extproc.tools.power_user import chat
from extproc.tools.procs import free_port
from extproc.tools.stack import Stack, start_stack
from tests.stackutil import metric, read_metrics, wait_for_metric, write_stack_config

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

MODES = ("NONE", "BUFFERED", "FULL_DUPLEX_STREAMED")
COMBINATIONS = [(metadata, mode) for metadata in (True, False) for mode in MODES]
# One request at a time on the picked model, so concurrent ones are held; the engine orders by `priority`.
FAST_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "0.1", "--scheduling-policy", "priority"]
SYSTEM = "You are the ACME support desk's assistant; answer briefly and kindly. " * 30  # ~2 KB: 4 blocks of 512 B
QUESTION: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is #1234?"}]
JSON_TO_METADATA = "envoy.filters.http.json_to_metadata"
# The reference a refusal is timed against: a request served whole, this many tokens long (2 ms a step: 0.4 s).
REFERENCE_TOKENS = 200


def _combination_id(combination: tuple[bool, str]) -> str:
    metadata, mode = combination
    return f"{'metadata' if metadata else 'no-metadata'}-{mode}"


def _http_filters(doc: dict[str, Any]) -> Iterator[list[dict[str, Any]]]:
    for listener in doc["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                if "http_filters" in network_filter["typed_config"]:
                    yield network_filter["typed_config"]["http_filters"]


def _set_body_modes(ext_proc: dict[str, Any], mode: str) -> None:
    processing = ext_proc["typed_config"]["processing_mode"]
    processing["request_body_mode"] = processing["response_body_mode"] = mode
    if mode == "FULL_DUPLEX_STREAMED":  # Envoy refuses a duplex request body without its trailers sent
        processing["request_trailer_mode"] = "SEND"


def _on_free_ports(doc: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``doc`` listening (and its admin) on free ports: another Envoy in front of the same processor."""
    port = free_port()
    doc["admin"]["address"]["socket_address"]["port_value"] = free_port()
    doc["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = port
    return doc, f"http://127.0.0.1:{port}"


def gateway_shape(config: Config, *, metadata: bool, mode: str) -> dict[str, Any]:
    """AI Gateway's InferencePool shape with the body modes ``mode``; ``metadata``: our json_to_metadata in front."""
    doc = gie_gateway.strict(config, "m1")
    (filters,) = _http_filters(doc)
    epp = next(f for f in filters if f["name"] == gie_gateway.EPP_FILTER)
    _set_body_modes(epp, mode)
    if metadata:
        filters.insert(filters.index(epp), next(f for f in http_filters(config) if f["name"] == JSON_TO_METADATA))
        epp["typed_config"]["metadata_options"]["forwarding_namespaces"]["untyped"].append(METADATA_NAMESPACE)
    return doc


def own_envoy(config: Config, *, mode: str) -> dict[str, Any]:
    """Our generated bootstrap, its ext_proc filter's body modes set to ``mode``."""
    doc = bootstrap(config)
    for filters in _http_filters(doc):
        for found in filters:
            if found["name"] == EXT_PROC_FILTER:
                _set_body_modes(found, mode)
    return doc


@dataclass
class Gateways:
    stack: Stack
    urls: dict[tuple[bool, str], str]  # the gateway shape per combination
    own: dict[str, str]  # our generated bootstrap per body mode

    @property
    def log(self) -> Path:
        return self.stack.workdir / "extproc.log"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateways(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Gateways]:
    """One processor and its engines; nine Envoys in front of it (about 10 s to start on 2 cores)."""
    workdir = tmp_path_factory.mktemp("attach")
    config_path = write_stack_config(workdir, {
        "m1": {"endpoint_picking": True, "gate": "static_concurrency", "max_in_flight": 1},
        "ranked": {"prefix": {}, "engine_priority": True, "check_stream_start": True},
    }, api_keys={})
    async with contextlib.AsyncExitStack() as running:
        stack = await running.enter_async_context(await start_stack(config_path, workdir, sim_args=FAST_SIM))
        urls: dict[tuple[bool, str], str] = {}
        own: dict[str, str] = {}
        for metadata, mode in COMBINATIONS:
            doc, urls[metadata, mode] = _on_free_ports(gateway_shape(stack.config, metadata=metadata, mode=mode))
            await running.enter_async_context(
                await start_envoy(doc, workdir / f"envoy-{_combination_id((metadata, mode))}", concurrency=1))
        for mode in MODES:
            doc, own[mode] = _on_free_ports(own_envoy(stack.config, mode=mode))
            await running.enter_async_context(await start_envoy(doc, workdir / f"envoy-own-{mode}", concurrency=1))
        yield Gateways(stack, urls, own)


async def _direct_prompt_tokens(stack: Stack, model: str, messages: list[dict[str, Any]]) -> int:
    """What the engine counts of the prompt when the body reaches it unchanged."""
    async with aiohttp.ClientSession() as session, session.post(
        f"{stack.sim_url(model)}/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 1}
    ) as response:
        return int((await response.json())["usage"]["prompt_tokens"])


async def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(status, the JSON answer); an answer that is not JSON (Envoy's own) as ``{"text": ...}``."""
    async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/chat/completions", json=body) as response:
        text = await response.text()
    try:
        return response.status, json.loads(text)
    except ValueError:
        return response.status, {"text": text, "details": response.headers.get("x-envoy-details", "")}


async def _timed_post(url: str, body: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
    """(seconds to the whole answer, status, the JSON answer), as :func:`_post`."""
    started = time.monotonic()
    status, answer = await _post(url, body)
    return time.monotonic() - started, status, answer


async def _served_s(url: str, model: str) -> float:
    """Seconds to the whole answer of the same question served: Envoy, the processor and REFERENCE_TOKENS of the
    engine's steps. A refusal "at once" takes less (a wait on a body that never comes would end at Envoy's 2 s
    message timeout, far longer); measured on the same machine at the same moment, it slows with it."""
    seconds, status, answer = await _timed_post(url, {"model": model, "messages": QUESTION,
                                                      "max_tokens": REFERENCE_TOKENS})
    assert status == 200, answer
    return seconds


@pytest.mark.parametrize("combination", COMBINATIONS, ids=_combination_id)
async def test_each_combination_serves_or_is_refused_at_once(gateways: Gateways, combination: tuple[bool, str]) -> None:
    metadata, mode = combination
    url = gateways.urls[combination]
    body = {"model": "m1", "messages": QUESTION, "max_tokens": 7}
    if not metadata and mode == "NONE":  # no model anywhere: nothing can be scheduled
        refused_s, status, answer = await _timed_post(url, body)
        assert (status, answer["error"]["code"]) == (400, "model_missing"), answer
        served_s = await _served_s(gateways.urls[True, "NONE"], "m1")  # the same shape, our metadata forwarded
        assert refused_s < served_s, (refused_s, served_s)
        assert "request_body_mode NONE" in answer["error"]["message"]
        assert "request_body_mode NONE" in gateways.log.read_text()  # the operator is told why, once
        return
    expected = await _direct_prompt_tokens(gateways.stack, "m1", QUESTION)
    status, answer = await _post(url, body)
    assert status == 200, answer
    assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]) == (expected, 7)  # the body intact
    metrics = gateways.stack.metrics_url
    waited_before = metric(await read_metrics(metrics), "extproc_queue_wait_seconds_count", model="m1")
    async with aiohttp.ClientSession() as session:
        # One at a time on m1: four streamed requests at once, three held and released in turn.
        outcomes = await asyncio.wait_for(asyncio.gather(*(
            chat(session, url, f"t{i}", "m1", api_key=None, max_tokens=12) for i in range(4)
        )), timeout=30)
    assert all(o.status == 200 and o.tokens == 12 for o in outcomes), outcomes
    assert metric(await read_metrics(metrics), "extproc_queue_wait_seconds_count", model="m1") - waited_before == 4
    assert await wait_for_metric(metrics, "extproc_in_flight", lambda v: v == 0, model="m1") == 0


@pytest.mark.parametrize("mode", MODES)
async def test_our_envoy_signs_the_prompt_and_rewrites_the_priority_in_every_body_mode(
    gateways: Gateways, mode: str,
) -> None:
    """A model with prefix signatures and engine_priority: the body read before the hold, rewritten in the release;
    and with check_stream_start, its streams' response body asked for in duplex in the same override."""
    expected = await _direct_prompt_tokens(gateways.stack, "ranked", QUESTION)
    metrics = gateways.stack.metrics_url
    signed_before = metric(await read_metrics(metrics), "extproc_prefix_blocks_count", model="ranked")
    # The engine refuses a non-integer priority (400): it got the class's number, in a body of the right length.
    status, answer = await _post(gateways.own[mode], {
        "model": "ranked", "messages": QUESTION, "max_tokens": 5, "priority": "not a number",
    })
    assert status == 200, answer
    assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]) == (expected, 5)
    assert metric(await read_metrics(metrics), "extproc_prefix_blocks_count", model="ranked") - signed_before == 1
    # A stream of it: its first event read before the headers go on (check_stream_start), in every mode too.
    async with aiohttp.ClientSession() as session:
        streamed = await chat(session, gateways.own[mode], "t", "ranked", api_key=None, max_tokens=6)
    assert (streamed.status, streamed.tokens) == (200, 6), streamed
    assert await wait_for_metric(metrics, "extproc_in_flight", lambda v: v == 0, model="ranked") == 0


@pytest.mark.parametrize("mode", MODES)
async def test_our_envoy_holds_a_request_past_its_message_timeout_in_every_body_mode(gateways: Gateways, mode: str) -> None:
    """The generated filter gives up on a silent processor after 2 s; the hold's override keeps it waiting longer."""
    assert gateways.stack.config.envoy.message_timeout_ms == 2000
    url = gateways.own[mode]
    async with aiohttp.ClientSession() as session:
        # m1 runs one request at a time: the long one (about 3 s of tokens) holds the short one.
        long = asyncio.create_task(chat(session, url, "long", "m1", api_key=None, max_tokens=1500))
        assert await wait_for_metric(gateways.stack.metrics_url, "extproc_in_flight", lambda v: v == 1, model="m1") == 1
        short = await chat(session, url, "short", "m1", api_key=None, max_tokens=4)
        done = await long
    assert (done.status, done.tokens) == (200, 1500), done
    assert (short.status, short.tokens) == (200, 4), short
    assert short.queue_wait_s is not None and short.queue_wait_s > gateways.stack.config.envoy.message_timeout_ms / 1000, short



async def test_a_body_asked_for_and_not_sent_is_refused_at_once_with_json(gateways: Gateways) -> None:
    """With our metadata and NONE in AI Gateway's shape, the override asking for a signed model's body is ignored.

    The headers reply has let the request go on unrouted; the processor answers the next message (the
    response's headers) with the JSON error instead of waiting for a body that never comes.
    """
    refused_s, status, answer = await _timed_post(gateways.urls[True, "NONE"],
                                                  {"model": "ranked", "messages": QUESTION, "max_tokens": 5})
    assert (status, answer["error"]["code"]) == (500, "gateway_error"), answer
    served_s = await _served_s(gateways.own["NONE"], "ranked")  # our Envoy honours the override: the body comes
    assert refused_s < served_s, (refused_s, served_s)
    assert "allow_mode_override" in gateways.log.read_text()
