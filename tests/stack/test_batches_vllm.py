"""A batch through real parts end to end: the OpenAI SDK, the generated Envoy, ``extproc serve``, the real vLLM.

The CPU build of vLLM behind the session fixture ``vllm`` (tests/conftest.py;
skipped, saying why, where vLLM is not installed). One short batch: every
line once in the output file with vLLM's answer, released by the processor
as the tenant in its lowest class, and counted once by vLLM itself (its
``vllm:request_success_total``), so no line ran twice at the engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.tools.procs import free_port
from extproc.tools.realvllm import REQUEST_EXTRAS
from extproc.tools.stack import start_stack
from tests.batchutil import chat_line, client, entries, jsonl, wait_final
from tests.stackutil import metric, read_metrics, write_stack_config
from tests.vllmutil import FCFS, FCFS_MODEL, PRIORITY, VllmServers

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.vllm, pytest.mark.alone]
VLLM_SERVERS = (FCFS, PRIORITY)  # the session's pair (the ``vllm`` fixture), started at once with the other modules' (vllm_fleet)
IN_SESSION_LOOP = pytest.mark.asyncio(loop_scope="session")

LINES = 12
MAX_TOKENS = 8


async def engine_successes(url: str) -> float:
    """Requests vLLM finished so far, whatever their finish reason."""
    samples = await read_metrics(f"{url}/metrics")
    return sum(value for (name, labels), value in samples.items()
               if name == "vllm:request_success_total" and ("model_name", FCFS_MODEL) in labels)


@IN_SESSION_LOOP
async def test_the_sdk_batch_workflow_runs_each_line_once_on_vllm(vllm: VllmServers, tmp_path: Path) -> None:
    config = write_stack_config(
        tmp_path, {FCFS_MODEL: {"endpoints": [vllm.fcfs], "max_running": 4}},
        batches={"directory": str(tmp_path / "batches"), "listen": f"127.0.0.1:{free_port()}",
                 "runner_listen": f"127.0.0.1:{free_port()}", "in_flight_per_batch": 6},
        tenants={"bob": {"priorities": ["standard", "batch"]}},
    )
    lines = [chat_line(f"r{i}", MAX_TOKENS, FCFS_MODEL, **REQUEST_EXTRAS) for i in range(LINES)]
    before = await engine_successes(vllm.fcfs)
    async with await start_stack(config, tmp_path, engines=False) as stack, client(stack.envoy_url, "bob") as sdk:
        uploaded = await sdk.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
        done = await wait_final(sdk, batch.id, timeout_s=180)
        assert done.status == "completed", done
        out = await entries(sdk, done.output_file_id)
        samples = await read_metrics(stack.metrics_url)
    assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
    assert done.model == FCFS_MODEL and done.error_file_id is None
    assert sorted(e["custom_id"] for e in out) == sorted(f"r{i}" for i in range(LINES))
    assert all(e["response"]["status_code"] == 200 and e["response"]["body"]["model"] == FCFS_MODEL for e in out)
    assert done.usage is not None and done.usage.output_tokens == LINES * MAX_TOKENS
    assert metric(samples, "extproc_released_total", tenant="bob", priority="batch") == LINES
    assert await engine_successes(vllm.fcfs) - before == LINES
