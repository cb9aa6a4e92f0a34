"""Run a real Envoy from a bootstrap dict (tests and the demo).

    async with await start_envoy(bootstrap(config), tmp_path) as envoy:
        ...  # envoy.admin_url, envoy.log_path

Envoy runs with ``--disable-hot-restart`` (no shared memory, so several can run
at once without ``--base-id``) and logs, with its stdout access log, to
``envoy.log`` in the work directory. Ready means admin ``/ready`` answers 200.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from extproc.adapters.envoy import render
from extproc.tools.envoy_bin import find_envoy
from extproc.tools.procs import ManagedProcess


class EnvoyProcess(ManagedProcess):
    """A running Envoy; ``admin_url`` is taken from the bootstrap's admin address."""

    admin_url: str
    config_path: Path


async def start_envoy(
    bootstrap: dict[str, Any],
    workdir: Path,
    *,
    log_level: str = "warning",
    ready_timeout: float = 20.0,
    concurrency: int = 2,
) -> EnvoyProcess:
    """Write ``bootstrap`` into ``workdir``, start Envoy and wait for admin /ready.

    ``concurrency`` sets Envoy's worker threads: two are plenty for a demo or a
    test and keep a 2-core machine usable. On failure Envoy is stopped and the
    error (:class:`~extproc.tools.procs.ProcessStartError`) carries its log's tail.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "envoy.yaml"
    config_path.write_text(render(bootstrap), encoding="utf-8")
    admin = bootstrap["admin"]["address"]["socket_address"]
    admin_url = f"http://{admin['address']}:{admin['port_value']}"
    command = [
        find_envoy(), "-c", str(config_path), "--disable-hot-restart",
        "--log-level", log_level, "--concurrency", str(concurrency),
    ]
    envoy = await EnvoyProcess.start(
        "envoy", command, workdir / "envoy.log", ready_url=f"{admin_url}/ready", timeout=ready_timeout
    )
    envoy.admin_url = admin_url
    envoy.config_path = config_path
    return envoy
