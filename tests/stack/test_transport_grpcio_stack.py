"""``listen.transport: grpcio``: the whole stack (Envoy, the processor on grpc.aio, the simulator) serves.

The differential suite (test_transport_differential.py) compares the two
transports on a fake service; this checks the reference transport carries the
real one: Envoy's ext_proc streams held in the queue and released, its gRPC
health check answered, in the processor as ``extproc serve`` runs it (uvloop).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import yaml

from extproc.tools.stack import start_stack
from tests.stackutil import metric, read_metrics, send_chat, write_config

pytestmark = pytest.mark.integration

# One sequence at a time on the engine, so most of the requests wait in the processor's queue.
SLOW_SIM = ["--max-num-seqs", "1", "--step-ms", "20", "--time-scale", "0.1"]


async def test_the_stack_serves_held_requests_on_the_grpcio_transport(tmp_path: Path) -> None:
    path = write_config(tmp_path, target_waiting=1)
    doc = yaml.safe_load(path.read_text())
    doc["listen"]["transport"] = "grpcio"
    path.write_text(yaml.safe_dump(doc))
    async with await start_stack(path, tmp_path, sim_args=SLOW_SIM) as stack, aiohttp.ClientSession() as session:
        tenants = ("alice", "bob", "carol", "dave") * 3
        outcomes = await asyncio.gather(*(send_chat(session, stack, tenant, max_tokens=8) for tenant in tenants))
        assert [o.status for o in outcomes] == [200] * len(tenants), [o.error for o in outcomes if o.error]
        assert all(o.ttft_s is not None for o in outcomes)
        samples = await read_metrics(stack.metrics_url)
        assert metric(samples, "extproc_released_total") == len(tenants)
        # Held, not passed straight through: the queue waits were real (some waited behind others).
        assert metric(samples, "extproc_queue_wait_seconds_sum") > 0
        assert stack.processor is not None
        assert "(transport grpcio)" in stack.processor.log_path.read_text()
