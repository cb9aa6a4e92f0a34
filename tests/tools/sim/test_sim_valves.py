"""The simulator's queue caps answer as vLLM 0.32's do (measured on the real one: docs/engines.md)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from extproc.adapters.protocol.dialects import parse_load
from extproc.tools.sim import SimSettings, start_sim

pytestmark = pytest.mark.unit

BUSY = "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."


async def _ask(session: aiohttp.ClientSession, url: str, stream: bool) -> tuple[int, bytes]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": stream}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        return response.status, await response.read()


async def test_a_full_engine_refuses_with_vllms_503_and_a_burst_of_streams_with_200_and_the_error() -> None:
    settings = SimSettings(model="m", max_num_seqs=2, max_num_queued_reqs=3, time_scale=0.05, visibility_delay_ms=0)
    async with await start_sim(settings) as sim, aiohttp.ClientSession() as session:
        # Arriving together, every request passes the first check: the ones over the cap fail the second.
        whole = await asyncio.gather(*(_ask(session, sim.url, stream=False) for _ in range(6)))
        streams = await asyncio.gather(*(_ask(session, sim.url, stream=True) for _ in range(6)))
        # Arriving at an engine that is full already: refused before the stream begins.
        held = [asyncio.create_task(_ask(session, sim.url, stream=True)) for _ in range(3)]
        await asyncio.sleep(0.02)
        late = await _ask(session, sim.url, stream=True)
        await asyncio.gather(*held)
        async with session.get(f"{sim.url}/metrics") as response:
            page = await response.text()
    refused = [body for status, body in whole if status == 503]
    assert len(refused) == 3 and sum(status == 200 for status, _ in whole) == 3
    assert json.loads(refused[0]) == {"error": {"message": BUSY, "type": "Service Unavailable", "param": None, "code": 503}}
    errors = [body for status, body in streams if status == 200 and b'"error"' in body]
    assert len(errors) == 3
    first, done = errors[0].decode().split("\n\n")[:2]
    assert json.loads(first.removeprefix("data: "))["error"]["code"] == 503 and done == "data: [DONE]"
    assert late[0] == 503
    assert parse_load("vllm", page, "m").rejected == 7


async def test_the_token_cap_counts_prompts_not_yet_prefilled() -> None:
    settings = SimSettings(model="m", max_num_queued_tokens=100, time_scale=0.05, visibility_delay_ms=50)
    async with await start_sim(settings) as sim, aiohttp.ClientSession() as session:
        body = {"model": "m", "prompt": "x" * 400, "max_tokens": 5}  # 100 tokens
        async with session.post(f"{sim.url}/v1/completions", json=body) as first:
            assert first.status == 200
        results = await asyncio.gather(*(
            session.post(f"{sim.url}/v1/completions", json=body) for _ in range(2)
        ))
        statuses = sorted(r.status for r in results)
        for r in results:
            r.release()
    assert statuses == [200, 503]
