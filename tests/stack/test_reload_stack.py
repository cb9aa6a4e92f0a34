"""Live configuration through real parts: SIGHUP to ``extproc serve`` behind a real Envoy, engines simulated.

What an operator expects (docs/configuration.md, "Reloading"): requests held
in the queue across a reload are all served; a changed weight governs the
requests already queued; an added tenant and an added model serve (the model
once Envoy runs the new generated config, which the processor says it must);
a bad file keeps the old config, names its key path and counts a rejection;
a removed model's queue drains for ``--drain-seconds`` and the rest is
answered 404 ``model_not_found``; a rebuilt model's old queue drains beside
the new one. Assertions are on counts, statuses and order, not speed.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc.adapters.config import ModelConfig, load_config
from extproc.adapters.envoy import bootstrap
from extproc.adapters.reload import ConfigSource, Reloader
from extproc.adapters.server import ProcessorServer
from extproc.core.values.outcomes import Refusal, Refused
from extproc.tools.envoy_proc import start_envoy
from extproc.tools.power_user import Outcome, chat
from extproc.tools.procs import free_port
from extproc.tools.stack import Stack, start_sim, start_stack
from tests.stackutil import TENANT_KEYS, metric, read_metrics, send_chat, wait_for_metric, write_stack_config

pytestmark = pytest.mark.integration

# Real-time steps: a token every 20 ms.
SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "1"]
ONE_AT_A_TIME: dict[str, Any] = {"gate": "static_concurrency", "max_in_flight": 1}


def rewrite(path: Path, change: Any) -> dict[str, Any]:
    """Edit the config file in place as an operator would (``change`` mutates the document); the new document."""
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc))
    return doc


async def reloaded(stack: Stack, outcome: str, count: int) -> float:
    assert stack.processor is not None
    stack.processor.process.send_signal(signal.SIGHUP)
    return await wait_for_metric(stack.metrics_url, "extproc_config_reloads_total", lambda v: v >= count,
                                 outcome=outcome)


def in_order(tasks: list[asyncio.Task[Outcome]]) -> list[str]:
    """The tenants of ``tasks`` in the order they complete (one in flight at a time: the release order)."""
    order: list[str] = []
    for task in tasks:
        task.add_done_callback(lambda t: order.append(t.result().tenant))
    return order


def mean_rank(order: list[str], tenant: str) -> float:
    ranks = [i for i, t in enumerate(order) if t == tenant]
    return sum(ranks) / len(ranks)


@asynccontextmanager
async def reloadable(tmp_path: Path) -> AsyncIterator[tuple[Path, ProcessorServer, Reloader]]:
    """An in-process ProcessorServer on m1 (one at a time), started, and the Reloader a SIGHUP would drive."""
    path = write_stack_config(tmp_path, {"m1": ONE_AT_A_TIME})  # a static gate: ready without a scrape
    source = ConfigSource(path)
    text = path.read_bytes()
    server = ProcessorServer(source.load(text)[0])
    await server.start()
    try:
        yield path, server, Reloader(source, text, server, server.telemetry)
    finally:
        await server.close()


async def test_sighup_applies_a_weight_a_tenant_and_a_model_without_dropping_the_queue(tmp_path: Path) -> None:
    config = write_stack_config(tmp_path, {"m1": {**ONE_AT_A_TIME, "policy": "vtc"}},
                                tenants={"alice": {"weight": 1}, "bob": {"weight": 1}})
    async with await start_stack(config, tmp_path, sim_args=SIM) as stack:
        # The engine of the model to be added, up before anything is queued (the reload must come quickly).
        m2_endpoint = f"http://127.0.0.1:{free_port()}"
        stack.sims.append(await start_sim(ModelConfig(name="m2", endpoints=(m2_endpoint,)), m2_endpoint, tmp_path, SIM))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=120)) as session:
            holding = send_chat(session, stack, "dave", 250)  # the one slot, for about 5 s
            assert await wait_for_metric(stack.metrics_url, "extproc_in_flight", lambda v: v == 1, model="m1") == 1
            queued = [send_chat(session, stack, tenant, 8) for _ in range(8) for tenant in ("alice", "bob")]
            depth = await wait_for_metric(stack.metrics_url, "extproc_queue_depth", lambda v: v == 16, model="m1")
            assert depth == 16
            order = in_order(queued)

            new_envoy = {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}"}

            def change(doc: dict[str, Any]) -> None:
                doc["tenants"] = {"alice": {"weight": 1}, "bob": {"weight": 4}, "carol": {"weight": 1}}
                doc["models"].append({"name": "m2", "endpoints": [m2_endpoint]})
                doc["envoy"].update(new_envoy)  # where the rolled Envoy listens; the processor does not mind

            rewrite(config, change)
            assert await reloaded(stack, "applied", 1) == 1
            assert not holding.done(), "the reload came after the queue began to move: the test would mean little"
            samples = await read_metrics(stack.metrics_url)
            assert metric(samples, "extproc_envoy_config_stale") == 1  # a new model: Envoy must roll

            outcomes = await asyncio.gather(holding, *queued)
            # The added tenant is served under its own name.
            carol = await send_chat(session, stack, "carol", 4)
            # The rolled Envoy (the new generated config) routes the added model.
            rolled = await start_envoy(bootstrap(load_config(config)), tmp_path / "envoy-rolled")
            try:
                served = await chat(session, f"http://{new_envoy['listen']}", "carol", "m2",
                                    api_key=TENANT_KEYS["carol"], max_tokens=4)
            finally:
                await rolled.stop()

            # A bad file: rejected, the old config serves on.
            rewrite(config, lambda doc: doc["models"][0].update(target_waiting="three"))
            assert await reloaded(stack, "rejected", 1) == 1
            after_bad = await send_chat(session, stack, "alice", 4)
            samples = await read_metrics(stack.metrics_url)
    log = (tmp_path / "extproc.log").read_text()

    assert [o.status for o in outcomes] == [200] * 17, outcomes  # all queued across the reload: served, none dropped
    # Equal weights would interleave alice and bob (mean ranks within 1); bob at 4 goes first.
    assert sorted(order) == sorted(["alice", "bob"] * 8)
    assert mean_rank(order, "bob") + 3 < mean_rank(order, "alice"), order
    assert carol.status == 200 and metric(samples, "extproc_released_total", tenant="carol") >= 1
    assert served.status == 200 and served.tokens == 4, served
    assert metric(samples, "extproc_released_total", model="m2") == 1
    assert after_bad.status == 200
    assert metric(samples, "extproc_config_reloads_total", outcome="applied") == 1
    assert metric(samples, "extproc_config_reloads_total", outcome="rejected") == 1
    assert re.search(r"config reload \(SIGHUP\) applied in [\d.]+ ms .*models added m2.*tenants added carol", log), log
    assert re.search(r"config reload \(SIGHUP\) rejected.*models\[0\]\.target_waiting: must be an integer", log), log


async def test_a_removed_models_queue_drains_then_is_answered_404(tmp_path: Path) -> None:
    config = write_stack_config(tmp_path, {"m1": {}, "m2": ONE_AT_A_TIME})
    async with await start_stack(config, tmp_path, sim_args=SIM, serve_args=["--drain-seconds", "1"]) as stack:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=120)) as session:
            running = send_chat(session, stack, "alice", 150, model="m2")  # about 3 s: longer than the drain
            assert await wait_for_metric(stack.metrics_url, "extproc_in_flight", lambda v: v == 1, model="m2") == 1
            queued = [send_chat(session, stack, "bob", 4, model="m2") for _ in range(4)]
            assert await wait_for_metric(stack.metrics_url, "extproc_queue_depth", lambda v: v == 4, model="m2") == 4

            rewrite(config, lambda doc: doc["models"].pop())
            assert await reloaded(stack, "applied", 1) == 1
            arriving = await send_chat(session, stack, "carol", 4, model="m2")
            still = await send_chat(session, stack, "carol", 4, model="m1")
            left = await asyncio.gather(*queued)
            finished = await running
            samples = await read_metrics(stack.metrics_url)

    def error(outcome: Outcome) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(outcome.error)["error"]
        return body

    assert [o.status for o in left] == [404] * 4, left  # every queued request ended, with the reason
    assert {error(o)["code"] for o in left} == {"model_not_found"}
    assert all("was removed from the configuration while this request was queued" in error(o)["message"] for o in left)
    assert arriving.status == 404 and error(arriving)["code"] == "model_not_found"  # as any unknown model
    assert still.status == 200
    assert finished.status == 200 and finished.tokens == 150  # released before: it runs to its end
    assert metric(samples, "extproc_rejected_total", model="m2", reason="model_not_found") == 4


async def test_a_rebuilt_models_old_queue_drains_while_new_requests_go_to_the_new_one(tmp_path: Path) -> None:
    """A changed ``policy`` needs a new queue: the old one keeps its requests and order, then answers what is left."""
    async with reloadable(tmp_path) as (path, server, reloader):
        server.retire_drain_s = 0.3
        old = server.dispatchers["m1"]
        running = old.submit("alice", 1)
        waiting = [old.submit("bob", 1) for _ in range(3)]
        assert running.released and not any(h.released for h in waiting)
        rewrite(path, lambda doc: doc["models"][0].update(policy="vtc"))
        assert reloader.reload("test")
        new = server.dispatchers["m1"]
        assert new is not old
        assert server.queued() == 3  # still counted: a SIGTERM now would drain it too
        old.end(running)
        assert waiting[0].released  # the old queue goes on, in its order
        assert new.submit("carol", 1).released  # new requests: the new queue
        answers = await asyncio.gather(*(h.future for h in waiting[1:]), return_exceptions=True)
    assert [type(a) for a in answers] == [Refused, Refused]
    assert all(isinstance(a, Refused) and a.refusal is Refusal.SHUTTING_DOWN and "rebuilt" in a.message
               for a in answers)


async def test_a_model_added_whose_engine_is_not_up_yet_does_not_make_a_serving_processor_unready(
        tmp_path: Path) -> None:
    async with reloadable(tmp_path) as (path, server, reloader):
        metrics = server.config.listen.metrics
        readyz = f"http://{metrics}/readyz"
        async with aiohttp.ClientSession() as session:
            async with session.get(readyz) as before:
                assert before.status == 200
            # m2 reads metrics, and nothing listens at its endpoint yet.
            rewrite(path, lambda doc: doc["models"].append({"name": "m2", "endpoints": [f"http://127.0.0.1:{free_port()}"]}))
            assert reloader.reload("test")
            # A few failed scrapes of m2 (the counter is the processor's own, read in process).
            assert await wait_for_metric(f"http://{metrics}/metrics", "extproc_scrape_errors_total", lambda v: v >= 3,
                                         model="m2") >= 3
            async with session.get(readyz) as after:
                assert after.status == 200, await after.text()
            async with session.get(f"http://{metrics}/status.json") as status:
                models = [m["name"] for m in (await status.json())["models"]]
    assert models == ["m1", "m2"]  # the status page shows it (not scraped yet)


async def test_changed_endpoints_and_limits_apply_to_the_same_dispatcher(tmp_path: Path) -> None:
    async with reloadable(tmp_path) as (path, server, reloader):
        live = server.dispatchers["m1"]
        held = [live.submit("alice", 1) for _ in range(3)]
        moved = f"http://127.0.0.1:{free_port()}"
        rewrite(path, lambda doc: doc["models"][0].update(endpoints=[moved], max_in_flight=3))
        assert reloader.reload("test")
        assert server.dispatchers["m1"] is live  # nothing rebuilt: the queue is the same object
        assert all(h.released for h in held)  # the raised cap released the two queued at once
        for _ in range(100):  # the restarted scraper takes the new member list
            if live.endpoints == (moved,):
                break
            await asyncio.sleep(0.01)
        assert live.endpoints == (moved,)
        for h in held:
            live.end(h)


async def test_a_shutdown_during_a_drain_or_a_rescrape_closes_every_scrapers_sessions(tmp_path: Path) -> None:
    """close() right after a reload retired a queue and restarted a scraper: their sessions close (no leak warning)."""
    async with reloadable(tmp_path) as (path, server, reloader):
        old = server.dispatchers["m1"]
        held = [old.submit("bob", 1) for _ in range(2)]
        assert not held[1].released  # queued: the old queue will drain, its scraper running
        rewrite(path, lambda doc: doc["models"][0].update(policy="vtc"))
        assert reloader.reload("test")
        rewrite(path, lambda doc: doc["models"][0].update(endpoints=[f"http://127.0.0.1:{free_port()}"]))
        assert reloader.reload("test")  # the new queue's scraper restarts
        await asyncio.sleep(0.05)  # the scrapers are running, their sessions open
    gc.collect()  # an unclosed aiohttp session warns here, which the suite's filterwarnings makes an error
