"""The suite's real vLLM servers, started before the tests that use them: ``python -m tests.fleet FILE``.

.ci/run starts this once vLLM is installed and ``.venv`` made, while the tests
not marked ``alone`` still run: a server's start is mostly one core importing torch and
vLLM (five take 50-80 s on two cores), time the ``alone`` tests would
otherwise wait out with the machine to themselves. It starts every server
the modules of ``tests/workers.py``'s ``VLLM_MODULES`` name, writes FILE
(``VllmFleet.save``) once all answer, and serves until SIGTERM or SIGINT;
``vllm_fleet`` (tests/conftest.py) uses them where ``EXTPROC_VLLM_FLEET``
names FILE. A server that does not start ends this with its error, and no
FILE.

.ci/run starts it niced, so that the tests running meanwhile keep the cores
first (starved of CPU, a processor sheds its batch class, as it should): once
up, the servers are given the usual priority back (``--renice``, where this
process may raise priorities: root), as the tests that measure them expect.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import signal
import tempfile
from pathlib import Path

from tests.vllmutil import servers_of, start_fleet, stop_fleet
from tests.workers import VLLM_MODULES


async def serve(path: Path, *, renice: bool) -> None:
    modules = [importlib.import_module(module.removesuffix(".py").replace("/", ".")) for module in sorted(VLLM_MODULES)]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    workdir = Path(tempfile.mkdtemp(prefix="extproc-vllm-fleet-"))
    print(f"starting the vLLM servers; their logs: {workdir}", flush=True)
    fleet, running = await start_fleet(servers_of(modules), workdir)
    try:
        if renice:
            try:
                for server in running:  # the group: every process and thread of the server
                    os.setpriority(os.PRIO_PGRP, server.process.pid, 0)
            except PermissionError:
                print("warning: not allowed to raise the servers' priority back; they stay niced", flush=True)
        fleet.save(path)
        print(f"serving: {path}", flush=True)
        await stopping.wait()
    finally:
        path.unlink(missing_ok=True)
        await stop_fleet(running)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tests.fleet", description=__doc__.partition("\n")[0])
    parser.add_argument("file", type=Path, help="where to write the servers' URLs once all answer")
    parser.add_argument("--renice", action="store_true", help="give the servers the usual priority back once up")
    args = parser.parse_args()
    asyncio.run(serve(args.file, renice=args.renice))
