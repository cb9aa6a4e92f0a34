"""The batch API behind an Endpoint Picker gateway: the gateway's routes, not ours, in front of the EPP pods.

The gateway is a real Envoy in Envoy AI Gateway's InferencePool shape
(``tools/gie_gateway.py``, strict, duplex bodies) with the two routes of
deploy/gie/batches/ added as a gateway translates them (``with_batches``):
the SDK's workflow reaches the EPP's batch API through the gateway, and the
runner sends each line back through the gateway, on the route that needs the
runner's key, to the pool through the EPP like any request: released as the
batch's tenant in its lowest class, on the endpoint the EPP picked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.adapters.config import Config
from extproc.tools import gie_gateway
from extproc.tools.procs import free_port
from extproc.tools.stack import start_stack
from tests.batchutil import chat_line, entries, jsonl, wait_final
from tests.lazy import openai
from tests.stackutil import metric, read_metrics, write_stack_config

pytestmark = pytest.mark.integration

LINES = 10
RUNNER_KEY = "runner-secret"


async def test_the_sdk_batch_workflow_through_an_endpoint_picker_gateway(tmp_path: Path) -> None:
    envoy_listen = f"127.0.0.1:{free_port()}"
    path = write_stack_config(
        tmp_path, {"m1": {"endpoint_picking": True, "max_running": 4}}, api_keys={},
        envoy={"listen": envoy_listen},
        batches={"directory": str(tmp_path / "batches"), "listen": f"127.0.0.1:{free_port()}",
                 "gateway_url": f"http://{envoy_listen}", "runner_key": RUNNER_KEY},
        tenants={"bob": {"priorities": ["standard", "batch"]}},
    )

    def gateway(config: Config) -> dict[str, Any]:
        return gie_gateway.with_batches(gie_gateway.strict(config, "m1", body="duplex"), config)

    async with await start_stack(path, tmp_path, sim_args=["--max-num-seqs", "4"], envoy_bootstrap=gateway) as stack:
        tenant = {stack.config.identity.tenant_header: "bob"}  # what the gateway's auth would set
        async with openai.AsyncOpenAI(base_url=f"{stack.envoy_url}/v1", api_key="unused", max_retries=0,
                                      default_headers=tenant) as sdk:
            uploaded = await sdk.files.create(file=("in.jsonl", jsonl([chat_line(f"r{i}") for i in range(LINES)])),
                                              purpose="batch")
            batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                             completion_window="24h")
            done = await wait_final(sdk, batch.id)
            assert done.status == "completed", done
            out = await entries(sdk, done.output_file_id)
        # A wrong key matches only the users' route (where a real gateway's auth sets the tenant): a plain request.
        async with aiohttp.ClientSession() as http, http.post(
                f"{stack.envoy_url}/v1/chat/completions", headers={**tenant, "x-extproc-batch-key": "wrong"},
                json=chat_line("x")["body"]) as answer:
            assert answer.status == 200
        samples = await read_metrics(stack.metrics_url)
    assert sorted(e["custom_id"] for e in out) == sorted(f"r{i}" for i in range(LINES))
    assert all(e["response"]["status_code"] == 200 for e in out)
    assert metric(samples, "extproc_released_total", tenant="bob", priority="batch") == LINES
    assert metric(samples, "extproc_released_total", tenant="bob", priority="standard") == 1
