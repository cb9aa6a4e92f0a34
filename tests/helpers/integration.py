"""What other test modules share of test_integration.py's: FAST_SIM, gated_then_direct, sample_engine (written
for its tests).
"""

from __future__ import annotations

import asyncio

from extproc.tools.power_user import Outcome, PowerUser, run_power_user
from extproc.tools.stack import Stack
from tests.stackutil import TENANT_KEYS, metric, read_metrics

# A small, fast GPU: 4 sequences per batch, 10x faster than real time.
FAST_SIM = ["--max-num-seqs", "4", "--step-ms", "20", "--time-scale", "0.1"]


async def sample_engine(url: str, stop: asyncio.Event) -> list[tuple[float, float]]:
    """(running, waiting) as the engine reports them, every 20 ms until ``stop``."""
    seen = []
    while not stop.is_set():
        samples = await read_metrics(f"{url}/metrics")
        seen.append((metric(samples, "vllm:num_requests_running"), metric(samples, "vllm:num_requests_waiting")))
        await asyncio.sleep(0.02)
    return seen


async def gated_then_direct(
    stack: Stack, scenario: PowerUser
) -> tuple[list[Outcome], list[tuple[float, float]], list[Outcome]]:
    """The scenario through the gateway (the engine sampled meanwhile), then straight to the engine."""
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_engine(stack.sim_url(scenario.model), stop))
    gated = await run_power_user(stack.envoy_url, scenario, api_keys=TENANT_KEYS)
    stop.set()
    engine = await sampler
    return gated, engine, await run_power_user(stack.sim_url(scenario.model), scenario)
