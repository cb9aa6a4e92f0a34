"""``extproc demo`` as a user runs it: the table, then the gateway for their own requests, then Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys

import openai
import pytest

from extproc.adapters.config import load_config, split_address
from extproc.tools.demo import DEMO_CONFIG

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def port_is_free(address: str) -> bool:
    with socket.socket() as s:
        return s.connect_ex(split_address(address)) != 0


async def test_demo_shows_the_table_serves_the_sdk_and_cleans_up() -> None:
    config = load_config(str(DEMO_CONFIG))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "extproc", "demo", "--flood", "20",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    output = b""
    try:
        while b"Ctrl-C stops everything" not in output:
            line = await asyncio.wait_for(process.stdout.readline(), 120)
            assert line, output.decode()
            output += line
        text = output.decode()
        assert "alice (power user)" in text and "20/20" in text
        assert "bob (newcomer)" in text and "sooner through the gateway" in text

        # The README's OpenAI SDK example, against the running demo.
        client = openai.AsyncOpenAI(base_url=f"http://{config.envoy.listen}/v1", api_key="key-dave")
        async with client:
            reply = await client.chat.completions.create(
                model="demo-qwen", messages=[{"role": "user", "content": "Hello!"}], max_tokens=5
            )
        assert reply.choices[0].message.content
    finally:
        process.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(process.wait(), 60) == 0
    every_port = [config.envoy.listen, config.envoy.admin, config.listen.grpc, config.listen.metrics]
    every_port += [m.endpoints[0].removeprefix("http://") for m in config.models]
    assert all(port_is_free(address) for address in every_port)
