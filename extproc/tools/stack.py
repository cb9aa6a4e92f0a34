"""The whole local deployment as child processes: simulators, processor, Envoy.

The demo and the integration tests start exactly the same stack, from the
same config file, through the same CLI commands an operator would run.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal

from extproc.adapters.config import Config, ModelConfig, load_config
from extproc.adapters.envoy_config import bootstrap
from extproc.tools.envoy_proc import EnvoyProcess, start_envoy
from extproc.tools.procs import ManagedProcess

PYTHON = [sys.executable, "-m", "extproc"]

# What stands between clients and the simulators: nothing, Envoy alone
# (routing on the body's model, no ext_proc filter), or Envoy + extproc.
Gateway = Literal["direct", "envoy", "extproc"]


@dataclass
class Stack:
    config: Config
    sims: list[ManagedProcess] = field(default_factory=list)
    processor: ManagedProcess | None = None
    envoy: EnvoyProcess | None = None

    @property
    def envoy_url(self) -> str:
        return f"http://{self.config.envoy.listen}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.config.listen.metrics}/metrics"

    def sim_url(self, model: str) -> str:
        found = self.config.model(model)
        assert found is not None, model
        return found.endpoints[0]

    async def stop(self) -> None:
        """Stop Envoy first (no new traffic), then the processor, then the engines."""
        if self.envoy is not None:
            await self.envoy.stop()
        if self.processor is not None:
            await self.processor.stop()
        for sim in self.sims:
            await sim.stop()

    async def __aenter__(self) -> Stack:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def start_sim(model: ModelConfig, endpoint: str, workdir: Path, sim_args: Sequence[str] = ()) -> ManagedProcess:
    """One simulator for ``endpoint`` of ``model``, speaking its metric dialect (also to restart a killed one)."""
    host, _, port = endpoint.removeprefix("http://").rpartition(":")
    argv = [*PYTHON, "sim", "--host", host, "--port", port, "--model", model.name, "--dialect", model.engine, *sim_args]
    return await ManagedProcess.start(
        f"sim {model.name}", argv, workdir / f"sim-{model.name}-{port}.log", ready_url=f"{endpoint}/health"
    )


async def start_stack(
    config_path: Path,
    workdir: Path,
    *,
    sim_args: Sequence[str] = (),
    serve_args: Sequence[str] = (),
    gateway: Gateway = "extproc",
    engines: bool = True,
) -> Stack:
    """Start a simulator per model endpoint, ``extproc serve`` and Envoy.

    Each simulator speaks its model's ``engine`` metric dialect. ``sim_args``
    are extra ``extproc sim`` options (batch size, time scale, …) given to
    every simulator; ``serve_args`` extra ``extproc serve`` options.
    ``gateway`` leaves out the processor ("envoy") or both it and Envoy
    ("direct"): the benchmark's baselines. ``engines=False`` starts no
    simulator: the caller serves the model endpoints itself.
    """
    config = load_config(config_path)
    stack = Stack(config)
    try:
        for model in config.models if engines else ():
            for endpoint in model.endpoints:
                stack.sims.append(await start_sim(model, endpoint, workdir, sim_args))
        if gateway == "extproc":
            stack.processor = await ManagedProcess.start(
                "extproc serve",
                [*PYTHON, "serve", "--config", str(config_path), *serve_args],
                workdir / "extproc.log",
                ready_url=stack.metrics_url,
            )
        if gateway != "direct":
            stack.envoy = await start_envoy(bootstrap(config, ext_proc=gateway == "extproc"), workdir)
    except BaseException:
        await stack.stop()
        raise
    return stack
