"""A throwaway Redis for the tests and the benchmark's cluster arm: Debian's ``redis-server`` on loopback.

    async with RedisServer(tmp_path) as redis:   # started, answers PING
        ...  # redis.url; await redis.stop(); await redis.start()  (same port)

No persistence (``--save ''``, ``--appendonly no``): a restart begins empty,
as a Redis that lost its memory would, and nothing is written but the log.
The port stays the same across :meth:`RedisServer.stop` / :meth:`kill` and
:meth:`start`, so processors configured with :attr:`RedisServer.url` find it
again when it comes back (the Redis-outage scenarios).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from extproc.tools.procs import ProcessStartError, free_port, log_tail

BINARY = "redis-server"
HOST = "127.0.0.1"


class RedisUnavailable(RuntimeError):
    """No ``redis-server`` binary here; the message says how to install it."""


def find_redis_server() -> str:
    """The ``redis-server`` on PATH, else :class:`RedisUnavailable`."""
    found = shutil.which(BINARY)
    if found is None:
        raise RedisUnavailable(f"no {BINARY} on PATH (Debian/Ubuntu: apt-get install redis-server)")
    return found


class RedisServer:
    """One ``redis-server`` child on ``127.0.0.1:port``, stopped and started again on the same port."""

    def __init__(self, workdir: Path, *, port: int | None = None, binary: str | None = None) -> None:
        self.workdir = workdir
        self.port = free_port() if port is None else port
        self.binary = binary or find_redis_server()
        self.log_path = workdir / f"redis-{self.port}.log"
        self._process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        """What ``cluster.redis_url`` names: database 0 of this server."""
        return f"redis://{HOST}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    async def start(self, timeout_s: float = 10.0) -> None:
        """Start the server (again, on the same port) and wait until it answers PING."""
        if self.running:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [
            self.binary, "--bind", HOST, "--port", str(self.port), "--dir", str(self.workdir),
            "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", "",
        ]
        with open(self.log_path, "ab") as log:
            self._process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT
            )
        try:
            await self._wait_ready(timeout_s)
        except BaseException:
            await self.kill()
            raise

    async def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.returncode is not None:
                raise ProcessStartError(
                    f"redis-server exited with code {self._process.returncode}:\n{log_tail(self.log_path)}"
                )
            if await self.ping():
                return
            await asyncio.sleep(0.05)
        raise ProcessStartError(f"redis-server not answering PING on port {self.port} after {timeout_s:.0f}s:\n"
                                f"{log_tail(self.log_path)}")

    async def ping(self) -> bool:
        """Whether the server answers PING within a second (no retries: redis-py's default ones take seconds)."""
        client = aioredis.Redis(host=HOST, port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0,
                                retry=Retry(NoBackoff(), 0))
        try:
            return bool(await client.ping())
        except (RedisError, OSError):
            return False
        finally:
            await client.aclose()

    async def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM and wait for the exit (SIGKILL after ``timeout_s``); its exit code, None if it was not running."""
        return await self._end(signal.SIGTERM, timeout_s)

    async def kill(self) -> int | None:
        """SIGKILL: gone at once, as a crashed Redis is."""
        return await self._end(signal.SIGKILL, 10.0)

    async def _end(self, sig: int, timeout_s: float) -> int | None:
        process = self._process
        if process is None:
            return None
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(sig)
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        return process.returncode

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
