"""The whole local deployment as child processes: simulators, processor, Envoy.

The demo and the integration tests start exactly the same stack, from the
same config file, through the same CLI commands an operator would run.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from extproc.adapters.config import Config, ModelConfig, load_config
from extproc.adapters.envoy import bootstrap
from extproc.tools.envoy_proc import EnvoyProcess, start_envoy
from extproc.tools.procs import ManagedProcess

# The two commands, as child processes of this interpreter: `extproc` (serve) and `extproc-dev` (sim).
PYTHON = [sys.executable, "-m", "extproc"]
DEV = [sys.executable, "-m", "extproc.tools"]

# What stands between clients and the simulators: nothing, Envoy alone
# (routing on the body's model, no ext_proc filter), or Envoy + extproc.
Gateway = Literal["direct", "envoy", "extproc"]


# The name of a stack's only processor (its log: extproc.log); a cluster's instances go by their own.
SOLE = "extproc"


@dataclass
class Stack:
    config: Config
    # How processors are started (again): `extproc serve --config config_path *serve_args`, logs in workdir.
    config_path: Path
    workdir: Path
    serve_args: Sequence[str] = ()
    # The `extproc` command a processor runs as (tools/hosts.py's, to answer host names from a file).
    command: Sequence[str] = tuple(PYTHON)
    sims: list[ManagedProcess] = field(default_factory=list)
    # Name -> the running `extproc serve`: one per cluster.instances entry, else SOLE.
    processors: dict[str, ManagedProcess] = field(default_factory=dict)
    envoy: EnvoyProcess | None = None

    @property
    def processor(self) -> ManagedProcess | None:
        """The only processor (a cluster's first instance), for callers that run one."""
        return next(iter(self.processors.values()), None)

    @processor.setter
    def processor(self, process: ManagedProcess) -> None:
        self.processors[next(iter(self.processors), SOLE)] = process

    @property
    def envoy_url(self) -> str:
        return f"http://{self.config.envoy.listen}"

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Each processor's /metrics by name: every cluster instance, else SOLE at ``listen.metrics``."""
        instances = self.config.cluster.instances if self.config.cluster is not None else {}
        addresses = {name: instance.metrics for name, instance in instances.items()} or {SOLE: self.config.listen.metrics}
        return {name: f"http://{address}/metrics" for name, address in addresses.items()}

    @property
    def metrics_url(self) -> str:
        """The only processor's /metrics (a cluster's first instance)."""
        return next(iter(self.metrics_urls.values()))

    def sim_url(self, model: str) -> str:
        found = self.config.model(model)
        assert found is not None, model
        return found.endpoints[0]

    async def start_processor(self, name: str = SOLE) -> ManagedProcess:
        """Start processor ``name`` (again, after it was stopped or killed: same addresses, same log).

        A cluster instance runs ``extproc serve --instance NAME`` and logs to
        ``extproc-NAME.log``; the sole processor runs without it, to ``extproc.log``.
        """
        instance = [] if name == SOLE else ["--instance", name]
        argv = [*self.command, "serve", "--config", str(self.config_path), *instance, *self.serve_args]
        log = self.workdir / ("extproc.log" if name == SOLE else f"extproc-{name}.log")
        process = await ManagedProcess.start(" ".join(["extproc serve", *instance]), argv, log,
                                             ready_url=self.metrics_urls[name])
        self.processors[name] = process
        return process

    async def stop(self) -> None:
        """Stop Envoy first (no new traffic), then the processors (together: each drains), then the engines."""
        if self.envoy is not None:
            await self.envoy.stop()
        await asyncio.gather(*(processor.stop() for processor in self.processors.values()))
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
    argv = [*DEV, "sim", "--host", host, "--port", port, "--model", model.name, "--dialect", model.engine, *sim_args]
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
    envoy_bootstrap: Callable[[Config], dict[str, Any]] | None = None,
    command: Sequence[str] = tuple(PYTHON),
) -> Stack:
    """Start a simulator per model endpoint, ``extproc serve`` (one per ``cluster.instances`` entry) and Envoy.

    Each simulator speaks its model's ``engine`` metric dialect. ``sim_args``
    are extra ``extproc-dev sim`` options (batch size, time scale, …) given to
    every simulator; ``serve_args`` extra ``extproc serve`` options.
    ``gateway`` leaves out the processor ("envoy") or both it and Envoy
    ("direct"): the benchmark's baselines. ``engines=False`` starts no
    simulator: the caller serves the model endpoints itself.
    ``envoy_bootstrap`` replaces our generated bootstrap with another built
    from the config (a GIE gateway's shape: tools/gie_gateway.py).
    ``command`` is the `extproc` command the processors run as.
    """
    config = load_config(config_path)
    stack = Stack(config, config_path, workdir, serve_args, command)
    try:
        for model in config.models if engines else ():
            for endpoint in model.endpoints:
                stack.sims.append(await start_sim(model, endpoint, workdir, sim_args))
        if gateway == "extproc":
            for name in stack.metrics_urls:
                await stack.start_processor(name)
        if gateway != "direct":
            doc = bootstrap(config, ext_proc=gateway == "extproc") if envoy_bootstrap is None else envoy_bootstrap(config)
            stack.envoy = await start_envoy(doc, workdir)
    except BaseException:
        await stack.stop()
        raise
    return stack
