"""Run a real Envoy from a bootstrap dict (tests and the demo).

    async with await start_envoy(bootstrap(config), tmp_path) as envoy:
        ...  # envoy.admin_url, envoy.log_path

Envoy runs with ``--disable-hot-restart`` (no shared memory, so several can run
at once without ``--base-id``), writes its admin address to a file (so an
admin ``port_value: 0`` works too) and logs, with its stdout access log, to
``envoy.log`` in the work directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import aiohttp

from extproc.envoy_bin import find_envoy
from extproc.envoy_config import render

LOG_TAIL_LINES = 40
LOG_TAIL_CHARS = 6000


class EnvoyStartError(RuntimeError):
    """Envoy exited or never became ready; the message ends with its log's tail."""


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    tail = "\n".join(text.splitlines()[-lines:])[-LOG_TAIL_CHARS:]
    return tail or "(empty log)"


class EnvoyProcess:
    """A running Envoy; stop it with `await stop()` or `async with`."""

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        *,
        config_path: Path,
        log_path: Path,
        log_file: IO[bytes],
        admin_url: str = "",
    ) -> None:
        self.process = process
        self.config_path = config_path
        self.log_path = log_path
        self.admin_url = admin_url
        self._log_file = log_file

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return _tail(self.log_path, lines)

    async def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, wait up to `timeout`, then SIGKILL. Safe to call twice."""
        try:
            if self.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self.process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(self.process.wait(), timeout)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        self.process.kill()
                    await self.process.wait()
        finally:
            self._log_file.close()

    async def __aenter__(self) -> EnvoyProcess:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def _wait_ready(envoy: EnvoyProcess, address_path: Path, deadline: float) -> None:
    """Until Envoy's admin /ready answers 200; raises EnvoyStartError."""
    timeout = aiohttp.ClientTimeout(total=1.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            if envoy.returncode is not None:
                raise EnvoyStartError(
                    f"envoy exited with status {envoy.returncode} before it was ready; "
                    f"log {envoy.log_path}:\n{envoy.log_tail()}"
                )
            if not envoy.admin_url and address_path.exists():
                address = address_path.read_text(encoding="utf-8").strip()
                if address:
                    envoy.admin_url = f"http://{address}"
            if envoy.admin_url:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(f"{envoy.admin_url}/ready") as response:
                        if response.status == 200:
                            return
            if time.monotonic() > deadline:
                raise EnvoyStartError(
                    f"envoy was not ready in time (admin {envoy.admin_url or 'unknown'}); "
                    f"log {envoy.log_path}:\n{envoy.log_tail()}"
                )
            await asyncio.sleep(0.05)


async def start_envoy(
    bootstrap: dict[str, Any],
    workdir: Path,
    *,
    log_level: str = "warning",
    ready_timeout: float = 20.0,
    concurrency: int | None = 2,
    envoy_bin: str | None = None,
) -> EnvoyProcess:
    """Write `bootstrap` into `workdir`, start Envoy and wait for admin /ready.

    `concurrency` sets Envoy's worker threads (None: one per CPU, Envoy's
    default). On failure Envoy is stopped and EnvoyStartError carries the tail
    of its log.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "envoy.yaml"
    log_path = workdir / "envoy.log"
    address_path = workdir / "envoy-admin-address"
    config_path.write_text(render(bootstrap), encoding="utf-8")
    address_path.unlink(missing_ok=True)
    command = [
        envoy_bin or find_envoy(),
        "-c", str(config_path),
        "--disable-hot-restart",
        "--log-level", log_level,
        "--admin-address-path", str(address_path),
    ]
    if concurrency is not None:
        command += ["--concurrency", str(concurrency)]
    log_file = log_path.open("wb")
    try:
        process = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=asyncio.subprocess.STDOUT
        )
    except BaseException:
        log_file.close()
        raise
    envoy = EnvoyProcess(process, config_path=config_path, log_path=log_path, log_file=log_file)
    try:
        await _wait_ready(envoy, address_path, time.monotonic() + ready_timeout)
    except BaseException:
        await envoy.stop()
        raise
    return envoy
