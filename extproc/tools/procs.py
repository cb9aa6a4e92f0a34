"""Child processes for the demo and the tests: start, wait until ready, stop.

Each child logs to a file; when it dies or never becomes ready the error ends
with the tail of that log, which is usually the whole diagnosis.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import aiohttp

LOG_TAIL_LINES = 40
# Below Linux's ephemeral range (32768+): a port picked here cannot be taken
# meanwhile by an outgoing connection's source port, which a busy run makes
# hundreds of.
_PORTS = range(10_000, 32_000)
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, never the same twice in one process.

    For the configs of child processes (tests, benchmark): the child binds it a
    moment later, so it must not be handed out twice nor be an ephemeral port.
    """
    ports = port_range()
    while True:
        port = random.choice(ports)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port


def port_range() -> range:
    """The ports :func:`free_port` draws from: all of ``_PORTS``, or under pytest-xdist this worker's share.

    The workers are separate processes: each one's ``_handed_out`` cannot see
    the others', and two could hand out the same port before either child has
    bound it. Disjoint shares cannot collide. xdist names its workers gw0, gw1, ...
    in the environment, which the children (a demo, a benchmark) inherit.
    """
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count:
        return _PORTS
    share = len(_PORTS) // int(count)
    start = _PORTS.start + int(worker.removeprefix("gw")) * share
    return range(start, start + share)


class ProcessStartError(RuntimeError):
    """A child exited or never became ready; the message ends with its log's tail."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time that process ``pid`` has used so far (Linux ``/proc``)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the command name, which is in parentheses and may hold spaces.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


class ManagedProcess:
    """A running child; stop it with ``await stop()`` or ``async with``."""

    def __init__(self, name: str, process: asyncio.subprocess.Process, log_path: Path, *, group: bool = False) -> None:
        self.name = name
        self.process = process
        self.log_path = log_path
        self.group = group

    @classmethod
    async def start(
        cls,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        ready_url: str,
        timeout: float = 30.0,
        env: Mapping[str, str] | None = None,
        group: bool = False,
        cwd: Path | None = None,
    ) -> Self:
        """Run ``argv`` (in ``env``, else ours; in ``cwd``, else ours) and wait until ``ready_url`` answers 200.

        ``group`` runs the child in a process group of its own that ``stop()``
        ends whole: for servers whose worker processes would outlive a killed
        parent (vLLM's engine core and worker do).
        """
        with open(log_path, "ab") as log:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT, env=env,
                start_new_session=group, cwd=cwd,
            )
        child = cls(name, process, log_path, group=group)
        try:
            await child._wait_ready(ready_url, timeout)
        except BaseException:
            await child.stop()
            raise
        return child

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    async def _wait_ready(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
            while time.monotonic() < deadline:
                if self.process.returncode is not None:
                    raise ProcessStartError(
                        f"{self.name} exited with code {self.process.returncode}:\n{log_tail(self.log_path)}"
                    )
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(url) as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.05)
        raise ProcessStartError(f"{self.name} not ready at {url} after {timeout:.0f}s:\n{log_tail(self.log_path)}")

    async def stop(self, timeout: float = 10.0, sig: int = signal.SIGTERM) -> int:
        """Signal, wait up to ``timeout``, then kill. Returns the exit code; safe to call twice."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()
        if self.group:
            await self._end_group(timeout)
        assert self.process.returncode is not None
        return self.process.returncode

    async def _end_group(self, timeout: float) -> None:
        """Give the rest of the group ``timeout`` to exit after its leader (a clean exit frees shared memory), then kill it."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                os.killpg(self.process.pid, 0)
                await asyncio.sleep(0.05)
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group is gone

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
