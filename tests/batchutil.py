"""What the batch tests through real parts share: the SDK client of a tenant, input lines, waiting for the end."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import yaml

from extproc.tools.procs import free_port
from extproc.tools.stack import Stack
from tests.lazy import openai
from tests.stackutil import TENANT_KEYS, write_stack_config


def client(envoy_url: str, tenant: str) -> openai.AsyncOpenAI:
    """The OpenAI SDK as ``tenant`` (its test key) through the gateway at ``envoy_url``."""
    return openai.AsyncOpenAI(base_url=f"{envoy_url}/v1", api_key=TENANT_KEYS[tenant], max_retries=0)


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def chat_line(custom_id: str, max_tokens: int = 8, model: str = "m1", **extra: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"say {custom_id}"}],
                     "max_tokens": max_tokens, **extra}}


async def wait_final(sdk: openai.AsyncOpenAI, batch_id: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await sdk.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled") or time.monotonic() > deadline:
            return batch
        await asyncio.sleep(0.2)


async def entries(sdk: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await sdk.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines() if line]


async def completed_count(sdk: openai.AsyncOpenAI, batch_id: str) -> int:
    counts = (await sdk.batches.retrieve(batch_id)).request_counts
    return 0 if counts is None else counts.completed


def cluster_config(tmp_path: Path, redis_url: str, files: dict[str, Any]) -> Path:
    """Two instances on one Redis sharing bob's batches, each with its own API; ``files``: where the files are."""
    path = write_stack_config(
        tmp_path, {"m1": {"max_running": 4}}, redis_url=redis_url, cluster_instances=2,
        batches={**files, "runner_listen": f"127.0.0.1:{free_port()}", "in_flight_per_batch": 3},
        tenants={"bob": {"priorities": ["standard", "batch"]}},
    )
    doc = yaml.safe_load(path.read_text())
    for instance in doc["cluster"]["instances"].values():
        instance["batches"] = f"127.0.0.1:{free_port()}"  # each instance's own API
    path.write_text(yaml.safe_dump(doc))
    return path


def instance_api(stack: Stack, name: str) -> openai.AsyncOpenAI:
    """Instance ``name``'s batch API, as bob (the tenant header Envoy's auth would set)."""
    assert stack.config.cluster is not None
    address = stack.config.cluster.instances[name].batches
    return openai.AsyncOpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0,
                              default_headers={stack.config.identity.tenant_header: "bob"})
