"""What an engine says of its own limits: read from its info endpoint, bounding the gate, a tight cap told."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import pytest
import yaml

from extproc.adapters.config import ENGINES, load_config
from extproc.adapters.engines.limits import SOURCES, cap_advice, read_limits
from extproc.adapters.engines.probe import probe_session
from extproc.adapters.engines.scraper import scrape_endpoint
from extproc.adapters.runtime import build_runtimes
from extproc.adapters.telemetry import Telemetry
from extproc.adapters.web.app import warnings
from extproc.core.release.adaptive_limit import ConcurrencyLimit
from extproc.core.values.engine_load import EngineLimits, EngineLoad
from extproc.tools.sim import SimSettings, start_sim

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("engine", "document", "expected"), [
    # vLLM 0.32's GET /v1/models (captured): the context, nothing of its batch or queue caps.
    ("vllm", {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 512, "root": "/models/m"}]},
     EngineLimits(max_model_len=512)),
    # SGLang's GET /server_info: its server arguments; its queue cap counts waiting requests only.
    ("sglang", {"max_running_requests": 48, "max_queued_requests": 16, "context_length": 32768, "tp_size": 1},
     EngineLimits(max_running=48, max_held=64, max_model_len=32768)),
    ("sglang", {"max_running_requests": None, "max_queued_requests": None, "context_length": 4096},
     EngineLimits(max_model_len=4096)),
    # TGI's GET /info: max_concurrent_requests counts running and queued.
    ("tgi", {"model_id": "x", "max_concurrent_requests": 128, "max_total_tokens": 4096, "max_input_tokens": 4095},
     EngineLimits(max_held=128, max_model_len=4096)),
    # llama.cpp's GET /props: its slots; no queue cap.
    ("llamacpp", {"total_slots": 4, "default_generation_settings": {"n_ctx": 8192}},
     EngineLimits(max_running=4, max_model_len=8192)),
    ("tgi", {"max_concurrent_requests": "many", "max_total_tokens": True}, EngineLimits()),  # not numbers: nothing
])
def test_each_engine_says_its_limits_its_own_way(engine: str, document: dict[str, object], expected: EngineLimits) -> None:
    assert SOURCES[engine][0].read(document, "m") == expected


@pytest.mark.parametrize(("engine", "document", "expected"), [
    # vLLM 0.32's GET /server_info?config_format=json (development mode only), cut to what is read.
    ("vllm", {"vllm_config": {"scheduler_config": {"max_num_seqs": 8, "policy": "priority"}}, "vllm_env": {}},
     EngineLimits(max_running=8, priority_first="lower")),
    ("vllm", {"vllm_config": {"scheduler_config": {"max_num_seqs": 8, "policy": "fcfs"}}}, EngineLimits(max_running=8)),
    ("vllm", {"vllm_config": "VllmConfig(...)"}, EngineLimits()),  # the text format: nothing read
    # SGLang orders by priority only with --enable-priority-scheduling; higher values first unless told otherwise.
    ("sglang", {"max_running_requests": 8, "enable_priority_scheduling": True}, EngineLimits(max_running=8,
                                                                                            priority_first="higher")),
    ("sglang", {"max_running_requests": 8, "enable_priority_scheduling": True, "schedule_low_priority_values_first": True},
     EngineLimits(max_running=8, priority_first="lower")),
])
def test_an_engine_says_whether_it_orders_its_queue_by_priority(
    engine: str, document: dict[str, object], expected: EngineLimits
) -> None:
    assert SOURCES[engine][-1].read(document, "m") == expected


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
async def test_what_vllm_s_two_pages_say_is_read_together(policy: str) -> None:
    settings = SimSettings(model="m", max_num_seqs=5, kv_cache_tokens=1024, scheduling_policy=policy, dev_mode=True)
    async with await start_sim(settings) as sim, aiohttp.ClientSession() as session:
        said = await read_limits(session, sim.url, "vllm", "m", 2.0)
        async with await start_sim(SimSettings(model="m", kv_cache_tokens=1024)) as quiet:
            without = await read_limits(session, quiet.url, "vllm", "m", 2.0)
    assert said == EngineLimits(max_running=5, max_model_len=1024,
                                priority_first="lower" if policy == "priority" else None)
    assert without == EngineLimits(max_model_len=1024)  # no development mode: /v1/models alone


def test_a_queue_cap_below_what_the_gate_sends_is_told_with_the_fix() -> None:
    assert EngineLimits(max_running=4, max_held=7).too_tight(3, None) == ""
    told = EngineLimits(max_running=4, max_held=6).too_tight(3, None)
    assert "holds 6" in told and "at least 7" in told
    assert "at least 19" in EngineLimits(max_held=8).too_tight(3, 16)  # the batch from max_running or the peak
    assert EngineLimits(max_held=8).too_tight(3, None) == ""  # nothing known of the batch: nothing to say


def test_the_engines_limits_bound_the_learned_limit() -> None:
    limit = ConcurrencyLimit(3, target_waiting=3)
    limit.set_engine(max_running=16, max_held=17)
    assert limit.limit == 17  # it starts at the batch it says (plus target_waiting), within what it holds
    limit.observe(EngineLoad(waiting=9, running=3), at=0.1)  # a burst: never below the 16 it says it runs
    assert limit.limit == 16
    limit.observe(EngineLoad(waiting=0, running=16), at=0.2)
    assert limit.limit == 17  # never above what it holds before refusing
    unbounded = ConcurrencyLimit(3, target_waiting=3)
    unbounded.set_engine(max_running=16, max_held=None)
    assert unbounded.limit == 19


async def test_a_tight_cap_said_by_the_engine_is_warned_in_the_log_the_status_and_readyz(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = SimSettings(model="m1", max_num_seqs=4, max_num_queued_reqs=5)  # 4 running + 3 waiting do not fit
    async with await start_sim(settings, dialect="sglang") as sim:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump({"models": [{"name": "m1", "engine": "sglang", "endpoints": [sim.url]}]}))
        config = load_config(path)
        dispatcher = build_runtimes(config, Telemetry())["m1"].dispatcher
        caplog.set_level(logging.INFO, logger="extproc.health")
        async with aiohttp.ClientSession() as session, probe_session() as probes:
            task = asyncio.create_task(scrape_endpoint(session, config.models[0], dispatcher, sim.url, probes))
            await asyncio.sleep(0.5)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    status = dispatcher.status(top=5)
    [endpoint] = status.endpoints
    assert "queue cap holds 5" in endpoint.warning and "at least 7" in endpoint.warning
    assert [r for r in caplog.records if r.levelno == logging.WARNING and "queue cap holds 5" in r.getMessage()]
    assert warnings([status]) == [f"model 'm1': {sim.url}: {endpoint.warning}"]
    assert endpoint.limit is not None and endpoint.limit <= 5


def test_serve_says_for_every_engine_where_its_own_cap_must_be() -> None:
    """check-config cannot see the engine, so serve says it at start: every engine the config accepts has a line."""
    for engine in ENGINES:
        assert cap_advice(engine, 3)
    assert "--max-num-seqs + 3" in cap_advice("vllm", 3)
    assert "at least 5 plus" in cap_advice("sglang", 5)
