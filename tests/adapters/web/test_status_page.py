"""The metrics port: health, readiness, /metrics only at /metrics, and the live status page.

The unit tests drive the real aiohttp server over real HTTP with dispatchers
fed by hand (no engine). The integration test runs the whole stack (simulator,
processor, real Envoy), holds a flood behind a slow engine and loads the page
in headless Chromium (Debian ``chromium``), asserting on the DOM its script
drew; it is skipped with the reason where Chromium is missing, unless
``EXTPROC_CHROMIUM=require`` (CI).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from extproc.adapters.protocol.contract import REASON_HEADER
from extproc.adapters.web.app import TOP_TENANTS
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.values.engine_load import EngineLoad
from extproc.tools.stack import start_stack
from tests.helpers.status_page import OBJECTIVE_EVENTS, Port
from tests.stackutil import API_KEYS, TENANT_KEYS, wait_for_metric, write_config


@pytest.fixture
async def port() -> AsyncIterator[Port]:
    async with Port() as served:
        yield served


async def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as response:
        return response.status, dict(response.headers), await response.read()


def scrape(dispatcher: ModelDispatcher, running: float = 3, waiting: float = 1) -> None:
    for endpoint in dispatcher.endpoints:
        dispatcher.record_scrape(endpoint, EngineLoad(waiting=waiting, running=running), started_at=time.monotonic())


@pytest.mark.unit
async def test_healthz_answers_and_readyz_waits_for_a_scrape_and_turns_503_while_draining(port: Port) -> None:
    status, _, body = await get(f"{port.url}/healthz")
    assert status == 200 and b"alive" in body

    # Not scraped yet: not ready, naming the model. The static_rate model needs no scrape.
    status, headers, body = await get(f"{port.url}/readyz")
    assert status == 503 and headers[REASON_HEADER] == "not_ready"
    message = yaml.safe_load(body)["error"]["message"]
    assert "model 'm'" in message and "fixed" not in message and "draining" not in message

    scrape(port.m)
    status, _, body = await get(f"{port.url}/readyz")
    assert status == 200, body

    port.draining = True
    status, _, body = await get(f"{port.url}/readyz")
    assert status == 503 and "draining" in yaml.safe_load(body)["error"]["message"]
    # Alive all the same: a draining processor must not be restarted.
    assert (await get(f"{port.url}/healthz"))[0] == 200


@pytest.mark.unit
async def test_metrics_only_at_metrics_with_openmetrics_on_request_and_json_404_elsewhere(port: Port) -> None:
    status, headers, body = await get(f"{port.url}/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b"extproc_queue_depth" in body

    status, headers, body = await get(f"{port.url}/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200 and headers["Content-Type"].startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")

    for path in ("/metricsx", "/health", "/metrics/", "/anything"):
        status, headers, body = await get(f"{port.url}{path}")
        assert status == 404, path
        assert headers[REASON_HEADER] == "not_found"
        error = yaml.safe_load(body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "not_found"

    async with aiohttp.ClientSession() as http, http.post(f"{port.url}/metrics") as response:
        assert response.status == 405 and (await response.json())["error"]["code"] == "method_not_allowed"


@pytest.mark.unit
async def test_status_json_shows_rule_endpoints_and_the_top_tenants_per_class(port: Port) -> None:
    scrape(port.m, running=5, waiting=2)
    # One request goes (the adaptive limit starts small); the rest queue, in two classes
    # (interactive first: with its demand seen, batch only goes into free slots, and there are none).
    held = [port.m.submit("vip", 0) for _ in range(3)]
    held += [port.m.submit(f"t{i:02d}", 2) for i in range(TOP_TENANTS + 3) for _ in range(i + 1)]
    try:
        status, _, body = await get(f"{port.url}/status.json")
        assert status == 200
        doc = yaml.safe_load(body)
        assert doc["not_ready"] == [] and doc["draining"] is False
        models = {m["name"]: m for m in doc["models"]}
        m = models["m"]
        assert m["rule"] == "adaptive" and m["rule_rate"] is None
        assert m["queued"] == port.m.queued and m["in_flight"] == port.m.in_flight
        assert m["queued"] + m["in_flight"] == len(held)
        assert m["release_rate"] > 0
        [endpoint] = m["endpoints"]
        assert (endpoint["running"], endpoint["waiting"]) == (5, 2)
        assert endpoint["limit"] is not None and not endpoint["down"]
        assert endpoint["scraped_ago_s"] is not None and endpoint["scraped_ago_s"] >= 0

        bands = {b["name"]: b for b in m["bands"]}
        assert bands["interactive"]["queued"] + bands["batch"]["queued"] + m["in_flight"] == len(held)
        batch = bands["batch"]
        # The largest tenants first, only TOP_TENANTS of them; the rest summed.
        names = [t["tenant"] for t in batch["top_tenants"]]
        assert len(names) == TOP_TENANTS and names[0] == f"t{TOP_TENANTS + 2:02d}"
        counts = [t["queued"] for t in batch["top_tenants"]]
        assert counts == sorted(counts, reverse=True)
        assert batch["other_tenants"] == 3
        assert sum(counts) + batch["other_queued"] == batch["queued"]
        assert bands["standard"] == {"name": "standard", "queued": 0, "top_tenants": [], "other_queued": 0,
                                     "other_tenants": 0}

        # The one released request is interactive (5 s objective), released at once: met. Nothing else left.
        assert [b["name"] for b in m["objectives"]["bands"]] == ["interactive", "standard", "batch"]
        assert [b["since_start"] for b in m["objectives"]["bands"]] == [
            {"met": 1, "missed": 0, "preempted": 0}, *[{"met": 0, "missed": 0, "preempted": 0}] * 2]

        fixed = models["fixed"]
        assert fixed["rule"] == "static_rate" and fixed["rule_rate"] == 2
        # Never scraped: shown as such, and degraded does not apply to a rule that reads no metrics.
        assert fixed["endpoints"][0]["scraped_ago_s"] is None and fixed["endpoints"][0]["degraded"] is False
    finally:
        for request in held:
            port.m.end(request)


@pytest.mark.unit
async def test_status_json_shows_objectives_met_missed_and_preempted_per_class_and_tenant(port: Port) -> None:
    port.report(*OBJECTIVE_EVENTS)
    doc = yaml.safe_load((await get(f"{port.url}/status.json"))[2])
    objectives = {m["name"]: m["objectives"] for m in doc["models"]}
    assert objectives["fixed"]["bands"][0]["since_start"] == {"met": 0, "missed": 0, "preempted": 0}
    m = objectives["m"]
    assert m["window_s"] == 60
    interactive, standard, batch = m["bands"]
    assert interactive["since_start"] == {"met": 2, "missed": 2, "preempted": 0}
    # The slack at release: the median of 4, 3 and -0.5 s, the least -0.5 s (bob's, late). Carol was refused.
    assert interactive["recent"] == {"met": 2, "missed": 2, "preempted": 0, "slack_p50_s": 3.0, "slack_min_s": -0.5}
    assert [(t["tenant"], t["met"], t["missed"], t["slack_p50_s"]) for t in interactive["top_tenants"]] == [
        ("alice", 2, 0, 3.5), ("bob", 0, 1, -0.5), ("carol", 0, 1, None)]
    assert interactive["other_tenants"] == 0
    assert standard["recent"]["slack_p50_s"] is None
    assert batch["since_start"]["preempted"] == 2 and batch["top_tenants"][0]["tenant"] == "dave"


@pytest.mark.unit
async def test_the_page_is_served_at_the_root_and_sets_strings_as_text_only(port: Port) -> None:
    status, headers, body = await get(f"{port.url}/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    page = body.decode()
    assert "status.json" in page
    # Every string from the processor goes in as text: the script never parses markup.
    assert "innerHTML" not in page and "insertAdjacentHTML" not in page and "document.write" not in page


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Two sequences at a time, answers of 2 s: a flood stays queued for the whole test.
SLOW_SIM = ["--max-num-seqs", "2", "--step-ms", "20", "--time-scale", "1"]
# A tenant whose name is markup: the page must show it as text.
MARKUP_TENANT = "<img src=x onerror=alert(1)>eve"


def need_chromium() -> None:
    if CHROMIUM is None:
        if os.environ.get("EXTPROC_CHROMIUM") == "require":
            pytest.fail("chromium is required (EXTPROC_CHROMIUM=require) but not installed: apt-get install chromium")
        pytest.skip("chromium is not installed (apt-get install chromium)")


async def chromium(*args: str) -> str:
    """Headless Chromium's stdout; the page's script runs for the virtual-time budget first."""
    assert CHROMIUM is not None
    process = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
        "--virtual-time-budget=3000", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )
    stdout, _ = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0
    return stdout.decode()


def text_of(dom: str) -> str:
    """The DOM's visible text: scripts and styles dropped, then tags; entities kept, whitespace collapsed."""
    visible = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]*>", " ", visible))


@pytest.mark.integration
async def test_status_page_in_chromium_shows_a_flood_held_behind_a_slow_engine(tmp_path: Path) -> None:
    need_chromium()
    from extproc.tools.power_user import chat

    config = write_config(tmp_path)
    doc = yaml.safe_load(config.read_text())
    doc["envoy"]["api_keys"] = {**API_KEYS, "key-eve": MARKUP_TENANT}
    config.write_text(yaml.safe_dump(doc))
    base = f"http://{doc['listen']['metrics']}"
    async with await start_stack(config, tmp_path, sim_args=SLOW_SIM) as stack, aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)
    ) as http:
        # More than the gate lets go (its limit is learned), so that 15 stay queued while the page is read.
        senders = [("alice", TENANT_KEYS["alice"], 20), ("bob", TENANT_KEYS["bob"], 8), (MARKUP_TENANT, "key-eve", 3)]
        tasks = [
            asyncio.create_task(chat(http, stack.envoy_url, tenant, "m1", api_key=key, max_tokens=100))
            for tenant, key, n in senders for _ in range(n)
        ]
        assert await wait_for_metric(stack.metrics_url, "extproc_queue_depth", lambda v: v >= 15, model="m1") >= 15
        assert (await get(f"{base}/readyz"))[0] == 200

        dom = await chromium("--dump-dom", f"{base}/")
        text = text_of(dom)
        assert "ready" in text and "not ready" not in text, text
        assert "model m1" in text and "release rule: adaptive" in text
        sim = stack.sim_url("m1")
        assert sim in text
        # Queued per class and tenant: alice's flood the largest, bob's next, in the default class.
        row = re.search(r"standard all (\d+)", text)
        assert row is not None and int(row.group(1)) >= 15, text
        alice = re.search(r"alice (\d+)", text)
        bob = re.search(r"bob (\d+)", text)
        assert alice is not None and bob is not None and int(alice.group(1)) > int(bob.group(1)), text
        assert text.index("alice") < text.index("bob")
        # The engine's own numbers as scraped, and the release rate.
        endpoint = re.search(re.escape(sim) + r" (ok|degraded) (\d+) (\d+)", text)
        assert endpoint is not None and int(endpoint.group(2)) <= 2, text
        assert re.search(r"release rate: \d+\.\d/s", text), text
        # The objectives section is drawn for every class, with numbers: the flood's class has a 60 s objective.
        assert "TTFT objectives per class and tenant, last 60 s" in text, text
        for band in ("interactive", "standard", "batch"):
            assert re.search(band + r" all \d+ \d+ (\d+\.\d%|–) \d+ ", text), (band, text)
        met = re.search(r"standard all (\d+) \d+ ", text[text.index("TTFT objectives"):])
        assert met is not None and int(met.group(1)) > 0, text  # the flood's released requests met theirs
        # The markup tenant is text, escaped in the DOM, not an element.
        assert "&lt;img src=x onerror=alert(1)&gt;eve" in dom
        assert "<img" not in dom

        # Draining: not ready (an HTTP readiness probe takes it out), still alive, the page says why.
        assert stack.processor is not None
        stack.processor.process.send_signal(signal.SIGTERM)
        status, _, body = await get(f"{base}/readyz")
        for _ in range(100):
            if status == 503:
                break
            await asyncio.sleep(0.05)
            status, _, body = await get(f"{base}/readyz")
        assert status == 503 and b"draining" in body
        assert (await get(f"{base}/healthz"))[0] == 200
        dom = await chromium("--dump-dom", f"{base}/")
        assert "not ready: draining" in text_of(dom)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.integration
async def test_the_objectives_section_in_chromium_shows_each_class_and_its_tenants(port: Port) -> None:
    """The page drawn by Chromium from a processor whose telemetry saw releases on time and late, a refusal
    after its deadline and preemptions: the section shows their numbers, class by class."""
    need_chromium()
    port.report(*OBJECTIVE_EVENTS)
    text = text_of(await chromium("--dump-dom", f"{port.url}/"))
    assert "TTFT objectives per class and tenant, last 60 s" in text, text
    # class, tenant, met, missed, met %, preempted, slack at release p50 and min.
    assert "interactive all 2 2 50.0% 0 3.00 s -0.50 s" in text, text
    assert "alice 2 0 100.0% 0 3.50 s 3.00 s" in text, text
    assert "bob 0 1 0.0% 0 -0.50 s -0.50 s" in text, text
    assert "carol 0 1 0.0% 0 – –" in text, text
    assert "since start 2 2 50.0% 0 – –" in text, text
    assert "standard all 0 0 – 0 – –" in text, text
    assert "batch all 0 0 – 2 – – dave 0 0 – 2 – –" in text, text
