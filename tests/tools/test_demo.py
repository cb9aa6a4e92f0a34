"""``extproc-dev demo`` as a user runs it: the table, then the gateway for their own requests, then Ctrl-C.

It runs on ports of its own (``--port-base``), beside whatever else uses the
packaged demo's ports on this machine, and leaves no temporary folder behind.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import sys
from pathlib import Path

import pytest
import yaml

from extproc.adapters.config import parse_config, split_address
from extproc.adapters.ports import bind_problem
from extproc.tools.demo import DEMO_CONFIG, ENGINES_OFFSET, with_port_base
from extproc.tools.procs import port_range
from tests.lazy import openai

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def port_is_free(address: str) -> bool:
    with socket.socket() as s:
        return s.connect_ex(split_address(address)) != 0


def free_port_base() -> int:
    """A base whose demo ports (base .. base + ENGINES_OFFSET + 1) are all free now, among free_port()'s own."""
    ports = port_range()
    while True:
        base = random.randrange(ports.start, ports.stop - ENGINES_OFFSET - 2)
        if all(bind_problem(f"127.0.0.1:{port}") is None for port in range(base, base + ENGINES_OFFSET + 2)):
            return base


async def test_demo_shows_the_table_serves_the_sdk_and_cleans_up(tmp_path: Path) -> None:
    base = free_port_base()
    config = parse_config(with_port_base(yaml.safe_load(DEMO_CONFIG.read_text()), base))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "extproc.tools", "demo", "--flood", "20", "--port-base", str(base),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # where its temporary log folder goes
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

        # The OpenAI SDK, against the running demo (the README shows the same call).
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
    assert list(tmp_path.iterdir()) == []  # the log folder went with it
