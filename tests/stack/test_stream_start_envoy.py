"""Through Envoy 1.40: a stream the engine refuses inside its 200 reaches the client as 503 engine_full, never as a 200.

The simulator has vLLM's queue cap (``--max-num-queued-reqs``) and its two
checks: streams that arrive together pass the first and the ones over the cap
fail the second, after the 200 went out (tests/tools/sim/test_sim_valves.py). The gate
here releases a whole burst at once (``static_concurrency``), so the cap is
met. With ``check_stream_start`` every client gets its tokens or a 503 it can
retry; without it, the same burst hands some clients a 200 with the error
inside (the reason for the check, and proof that the burst meets the race).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from extproc.tools.power_user import Outcome
from extproc.tools.stack import start_stack
from tests.lazy import openai
from tests.stackutil import TENANT_KEYS, metric, read_metrics, send_chat, write_config

pytestmark = pytest.mark.integration

BURST = 40
CAP = 3
MAX_TOKENS = 8
SIM = ("--max-num-seqs", "2", f"--max-num-queued-reqs={CAP}", "--time-scale", "0.3", "--visibility-delay-ms", "0")
# How often the race comes depends on how the burst's requests meet in the simulator (a loaded machine spreads
# them out): bursts are sent again until one shows it, for at most this long.
MOST_S = 90.0


def stack_config(tmp_path: Path, check: bool) -> Path:
    """One model whose gate releases a whole burst at once into the capped simulator."""
    tmp_path.mkdir()
    return write_config(tmp_path, gate="static_concurrency", max_in_flight=BURST, check_stream_start=check)


async def bursts(tmp_path: Path, check: bool, until: Callable[[Outcome], bool]) -> list[Outcome]:
    """BURSTs of streams at once through the gateway, until one of their outcomes is ``until``; all outcomes."""
    async with await start_stack(stack_config(tmp_path, check), tmp_path, sim_args=SIM) as stack:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            outcomes: list[Outcome] = []
            deadline = time.monotonic() + MOST_S
            while not any(until(o) for o in outcomes) and time.monotonic() < deadline:
                outcomes += await asyncio.gather(*(send_chat(session, stack, "alice", MAX_TOKENS) for _ in range(BURST)))
        refused = metric(await read_metrics(stack.metrics_url), "extproc_release_refused_full_total", model="m1")
    turned = sum(engine_full(o) for o in outcomes)
    assert refused >= turned  # each one turned into a 503 also cut the gate's limit
    return outcomes


def empty(outcome: Outcome) -> bool:
    """A 200 without a token: the engine's refusal inside the stream."""
    return outcome.status == 200 and outcome.tokens == 0


def engine_full(outcome: Outcome) -> bool:
    """Our answer in the refused stream's place (the outcome keeps the body's first 200 characters)."""
    return outcome.status == 503 and "the engine refused the stream" in outcome.error


async def test_a_refusal_inside_a_stream_reaches_the_client_as_503_engine_full(tmp_path: Path) -> None:
    outcomes = await bursts(tmp_path / "on", True, engine_full)
    assert not [o for o in outcomes if empty(o)]
    assert any(engine_full(o) for o in outcomes), f"no refusal in {len(outcomes)} streams"
    # A refusal before the stream began is the engine's 503, retried by Envoy; only one that outlasts the
    # retries reaches the client, as that 503 (no reason header of ours).
    assert all(o.status == 200 and o.tokens == MAX_TOKENS or o.status == 503 for o in outcomes), outcomes
    # The control: the same bursts without the check hand clients the engine's error inside a 200.
    unchecked = await bursts(tmp_path / "off", False, empty)
    assert any(empty(o) for o in unchecked), f"no race in {len(unchecked)} streams"


async def test_the_openai_sdk_retries_the_503_and_every_stream_gets_its_tokens(tmp_path: Path) -> None:
    async with await start_stack(stack_config(tmp_path / "on", True), tmp_path, sim_args=SIM) as stack:
        client = openai.AsyncOpenAI(base_url=f"{stack.envoy_url}/v1", api_key=TENANT_KEYS["alice"], max_retries=5)

        async def tokens() -> int:
            stream = await client.chat.completions.create(
                model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS, stream=True)
            return sum([bool(c.choices and c.choices[0].delta.content) async for c in stream])

        counts: list[int] = []
        refused = 0.0
        deadline = time.monotonic() + MOST_S
        async with client:
            while not refused and time.monotonic() < deadline:
                counts += await asyncio.gather(*(tokens() for _ in range(BURST)))
                refused = metric(await read_metrics(stack.metrics_url), "extproc_release_refused_full_total", model="m1")
    assert counts == [MAX_TOKENS] * len(counts)
    assert refused >= 1, f"no refusal in {len(counts)} streams"  # refused inside their 200, and retried by the SDK
