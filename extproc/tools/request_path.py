"""``python -m extproc.tools.request_path``: which of our modules one released request crosses, and how often.

A development tool, not a benchmark: it counts calls, not time. It starts, in
this process, the processor (``ProcessorServer``, the default ``builtin``
transport) with a one-model config and a simulated engine
(``tools/sim``), and a real Envoy as a child process in front of them (our
generated bootstrap: the metadata fast path, as deployed). A few requests
warm everything up (imports, the Envoy's gRPC connection, the first scrape),
then one request is traced: from the moment its ext_proc stream's first bytes
reach the gRPC server (``Connection.data_received``) until the reply that
releases it (CONTINUE) is written to the socket (``Connection._flush`` after
the reply was queued). The gate never holds (``target_waiting`` far above
the queue): the request is released at once.

The trace is ``sys.setprofile`` on the event loop's thread (Python 3.11 has
no ``sys.monitoring``). Only frames of modules under ``extproc.`` count,
the tools' own (``extproc.tools.``, the simulator among them) excepted, and
only frames running outside any task or in a task that the traced request
started: a scrape's task, running beside the request, is not its path. A
timer that fires inside the window (a loop-lag probe) would still count, so
the request is traced three times and the least is printed (what runs
beside a request only ever adds calls). Each traced request waits a moment
first, so that the end of the one before (Envoy's RST_STREAM) is not read
in the same read as its first bytes.

Counted, per module: its *entries* (a call into one of its functions, or a
coroutine of it resumed, from a frame of another module or from the event
loop), in the order of first entry; in all, the *calls* (every function
call and coroutine resumption in our modules) and the *moves* (each time the
module that runs changes, by a call or a return, from one of our modules to
another).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import aiohttp

from extproc.adapters.config import parse_config
from extproc.adapters.envoy import bootstrap
from extproc.adapters.grpc.builtin.connection import Connection
from extproc.adapters.server import ProcessorServer
from extproc.tools.envoy_proc import start_envoy
from extproc.tools.procs import free_port
from extproc.tools.sim import SimSettings, start_sim

MODEL = "path-model"
TENANT = "path"
API_KEY = "key-path"
WARM_UP = 5
TRACES = 3
SETTLE_S = 0.1
# Where the request's path begins and ends (the builtin transport's connection).
_START: CodeType = Connection.data_received.__code__
_QUEUED: CodeType = Connection._drain.__code__  # noqa: SLF001 (the reply's bytes queued on the stream)
_WRITTEN: CodeType = Connection._flush.__code__  # noqa: SLF001 (and written to the socket)


@dataclass
class RequestPath:
    """One traced request: the modules it entered, in order of first entry, with their entries; calls and moves."""

    entries: Counter[str] = field(default_factory=Counter)
    calls: int = 0
    moves: int = 0
    # Each entry in order: (the module entered, its function, the module it came from; "" for the event loop).
    steps: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def modules(self) -> list[str]:
        return list(self.entries)  # a Counter keeps the order of first insertion

    def most_entered(self) -> tuple[str, int]:
        return max(self.entries.items(), key=lambda item: item[1])

    def lines(self, steps: bool = False) -> list[str]:
        out = [f"{len(self.entries)} modules, {sum(self.entries.values())} entries, {self.calls} calls, "
               f"{self.moves} moves between modules", "entries  module (in order of first entry)"]
        out += [f"{count:7d}  {module}" for module, count in self.entries.items()]
        if steps:
            out += ["", "every entry in order: module.function <- the module it came from"]
            out += [f"  {module}.{function} <- {caller or '(event loop)'}" for module, function, caller in self.steps]
        return out


def _ours(frame: FrameType) -> str | None:
    """The module of ``frame`` if it is one of the processor's (not a tool's), else None."""
    name = frame.f_globals.get("__name__", "")
    if isinstance(name, str) and name.startswith("extproc.") and not name.startswith("extproc.tools."):
        return name
    return None


class _Tracer:
    """The profile hook: armed, it starts at the stream's first bytes and stops once the release is written."""

    def __init__(self) -> None:
        self.path = RequestPath()
        self.done = asyncio.get_running_loop().create_future()
        self._running = False
        self._queued = False
        self._last: str | None = None  # the module of ours that ran last
        self._before: set[asyncio.Task[Any]] = asyncio.all_tasks()

    def hook(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            self._call(frame)
        elif event == "return" and self._running:
            self._return(frame)

    def _counted(self) -> bool:
        task = asyncio.current_task()
        return task is None or task not in self._before

    def _call(self, frame: FrameType) -> None:
        if not self._running:
            if frame.f_code is not _START:
                return
            self._running = True
        module = _ours(frame)
        if module is None or not self._counted():
            return
        if frame.f_code is _QUEUED:
            self._queued = True
        path = self.path
        path.calls += 1
        caller = frame.f_back
        came_from = None if caller is None else _ours(caller)
        if came_from != module:
            path.entries[module] += 1
            path.steps.append((module, frame.f_code.co_qualname, came_from or ""))
        if self._last is not None and self._last != module:
            path.moves += 1
        self._last = module

    def _return(self, frame: FrameType) -> None:
        module = _ours(frame)
        if module is None or not self._counted():
            return
        if frame.f_code is _WRITTEN and self._queued:
            sys.setprofile(None)
            self._running = False
            self.done.set_result(None)
            return
        caller = frame.f_back
        back = None if caller is None else _ours(caller)
        if back is not None and back != module:
            self.path.moves += 1
            self._last = back


def config_doc(sim_url: str) -> dict[str, Any]:
    """One model on one simulated engine, its gate never holding; our Envoy in front."""
    return {
        "listen": {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"},
        "models": [{"name": MODEL, "endpoints": [sim_url], "target_waiting": 1_000_000,
                    "advanced": {"fallback_max_in_flight": 1_000_000}}],
        "envoy": {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}",
                  "api_keys": {API_KEY: TENANT}},
    }


async def _ask(session: aiohttp.ClientSession, url: str) -> None:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hello"}]}
    async with session.post(f"{url}/v1/chat/completions", json=body,
                            headers={"authorization": f"Bearer {API_KEY}"}) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"a request through Envoy answered {response.status}")


async def _traced(session: aiohttp.ClientSession, url: str) -> RequestPath:
    # The previous request's stream ends after its response; its last frames (Envoy's RST_STREAM) must not arrive in
    # the same read as this request's first: a pause lets them come and go first.
    await asyncio.sleep(SETTLE_S)
    tracer = _Tracer()
    sys.setprofile(tracer.hook)
    try:
        await _ask(session, url)
        await asyncio.wait_for(tracer.done, 5)
    finally:
        sys.setprofile(None)
    return tracer.path


async def trace_request(workdir: Path, traces: int = TRACES) -> RequestPath:
    """Start the stack, warm it up, trace ``traces`` released requests: the one with the fewest calls."""
    sim = await start_sim(SimSettings(model=MODEL, time_scale=0.01))
    try:
        config = parse_config(config_doc(sim.url))
        server = ProcessorServer(config)
        await server.start()
        try:
            envoy = await start_envoy(bootstrap(config), workdir)
            try:
                url = f"http://{config.envoy.listen}"
                async with aiohttp.ClientSession() as session:
                    for _ in range(WARM_UP):
                        await _ask(session, url)
                    paths = [await _traced(session, url) for _ in range(traces)]
            finally:
                await envoy.stop()
        finally:
            await server.close()
    finally:
        await sim.stop()
    return min(paths, key=lambda path: path.calls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m extproc.tools.request_path",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workdir", help="Envoy's bootstrap and log (default: a new temporary folder)")
    parser.add_argument("--steps", action="store_true", help="also list every entry in order, with where it came from")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="request-path-") as scratch:
        path = asyncio.run(trace_request(Path(args.workdir or scratch)))
    print("\n".join(path.lines(args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
