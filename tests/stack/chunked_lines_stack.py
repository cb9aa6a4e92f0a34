"""A chat's time to first token through the whole stack while long batch lines fill every slot, whole or in chunks.

A measurement, not a test (docs/batches.md reports it): ``python -m
tests.stack.chunked_lines_stack [CHATS_S] [CHUNK ...]`` (default 60 s of chats,
chunk_tokens 0 and 128). Envoy, ``extproc serve`` and the simulator (16
sequences, 20 ms steps, prefix caching), a batch of 200 lines of 1,024 tokens
with 32 in flight; once every slot is full, chats of 16 tokens arrive as a
Poisson process of 4 a second, for seed 1 and 2. On a shared machine the tail
is partly the machine's: ``tests/core/chunked_lines.py`` is the repeatable one.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from extproc.tools.power_user import chat
from extproc.tools.procs import free_port
from extproc.tools.stack import start_stack
from tests.batchutil import chat_line, client, jsonl
from tests.stackutil import TENANT_KEYS, metric, read_metrics, write_stack_config

SIM = ["--max-num-seqs", "16", "--step-ms", "20", "--time-scale", "1", "--prefix-caching"]


async def run(chunk: int, workdir: Path, seed: int, chats_s: float) -> str:
    path = write_stack_config(
        workdir, {"m1": {"max_running": 16}},
        batches={"directory": str(workdir / "batches"), "listen": f"127.0.0.1:{free_port()}",
                 "runner_listen": f"127.0.0.1:{free_port()}", "in_flight_per_batch": 32, "chunk_tokens": chunk},
        tenants={"bob": {"priorities": ["standard", "batch"]}},
    )
    async with await start_stack(path, workdir, sim_args=SIM) as stack, client(stack.envoy_url, "bob") as sdk:
        lines = [chat_line(f"r{i}", max_tokens=1024) for i in range(200)]
        uploaded = await sdk.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        await asyncio.sleep(15)  # every slot full of batch lines
        rng, tasks = random.Random(seed), []
        async with aiohttp.ClientSession() as session:
            end = time.monotonic() + chats_s
            while time.monotonic() < end:
                tasks.append(asyncio.create_task(chat(session, stack.envoy_url, "alice", "m1",
                                                      api_key=TENANT_KEYS["alice"], max_tokens=16,
                                                      extra_headers={"x-priority": "interactive"})))
                await asyncio.sleep(rng.expovariate(4.0))
            outcomes = await asyncio.gather(*tasks)
        ttfts = sorted(o.ttft_s for o in outcomes if o.ttft_s is not None)
        samples = await read_metrics(stack.metrics_url)
        engine = await read_metrics(f"{stack.sim_url('m1')}/metrics")
        await sdk.batches.cancel(batch.id)
    return (f"seed {seed} chunk {chunk or 'whole':>5}: {len(ttfts)}/{len(outcomes)} chats, TTFT p50 "
            f"{statistics.median(ttfts) * 1000:.0f} ms, p99 {ttfts[int(0.99 * len(ttfts))] * 1000:.0f} ms; "
            f"{metric(samples, 'extproc_preemptions_total'):.0f} preempted, the engine generated "
            f"{metric(engine, 'vllm:generation_tokens_total'):.0f} tokens")


async def main() -> None:
    chats_s = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    chunks = [int(c) for c in sys.argv[2:]] or [0, 128]
    for seed in (1, 2):
        for chunk in chunks:
            with tempfile.TemporaryDirectory() as workdir:
                print(await run(chunk, Path(workdir), seed, chats_s), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
