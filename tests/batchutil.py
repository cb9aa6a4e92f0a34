"""What the batch tests through real parts share: the SDK client of a tenant, input lines, waiting for the end."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import openai

from tests.stackutil import TENANT_KEYS


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
