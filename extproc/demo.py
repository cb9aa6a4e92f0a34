"""``extproc demo``: the power-user problem and its fix, on a real Envoy, in one command.

Starts two simulated vLLM engines, the processor and Envoy (the same stack the
integration tests use), replays the power-user scenario through the gateway
and then straight to the engine (its plain FIFO), prints both side by side,
and keeps the gateway up for the user's own requests until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import tempfile
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.table import Table

from extproc.scenario import PowerUser, TenantSummary, run_power_user, summarize

DEMO_CONFIG = resources.files("extproc") / "data" / "demo.yaml"
# A small GPU: 8 sequences per batch, so a 200-request flood is a real backlog.
SIM_ARGS = ["--max-num-seqs", "8", "--step-ms", "20", "--time-scale", "0.25"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEMO_CONFIG), help="extproc config (default: the packaged demo)")
    parser.add_argument("--once", action="store_true", help="exit after the comparison table")
    parser.add_argument("--flood", type=int, default=200, help="requests the power user sends (default 200)")
    parser.add_argument("--workdir", help="where logs go (default: a new temporary folder)")


def _ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:,.0f} ms"


def comparison_table(gated: list[TenantSummary], direct: list[TenantSummary], flood_tenant: str) -> Table:
    table = Table(title="Power user vs. newcomers: same load, through the gateway and straight to the engine")
    for column in ("tenant", "requests", "gateway: queue wait p50 / p99", "gateway: TTFT p50 / p99",
                   "direct FIFO: TTFT p50 / p99"):
        table.add_column(column, justify="left" if column == "tenant" else "right")
    direct_by_tenant = {s.tenant: s for s in direct}
    for s in gated:
        d = direct_by_tenant[s.tenant]
        role = "power user" if s.tenant == flood_tenant else "newcomer"
        table.add_row(
            f"{s.tenant} ({role})",
            f"{s.ok}/{s.requests}",
            f"{_ms(s.wait_p50)} / {_ms(s.wait_p99)}",
            f"{_ms(s.ttft_p50)} / {_ms(s.ttft_p99)}",
            f"{_ms(d.ttft_p50)} / {_ms(d.ttft_p99)}",
        )
    return table


async def _wait_for_ctrl_c() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _demo(args: argparse.Namespace, console: Console) -> int:
    from extproc.stack import start_stack

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="extproc-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    with console.status("starting simulators, extproc and Envoy…"):
        stack = await start_stack(Path(args.config), workdir, sim_args=SIM_ARGS)
    async with stack:
        config = stack.config
        model = config.models[0].name
        keys = {tenant: key for key, tenant in config.envoy.api_keys.items()}
        scenario = PowerUser(model=model, flood=args.flood)
        console.print(f"[bold]{scenario.flood_tenant}[/] sends {scenario.flood} requests to {model}; "
                      f"{' and '.join(scenario.newcomers)} send one each {scenario.newcomer_delay_s}s later.")
        with console.status("1/2 through Envoy + extproc…"):
            gated = await run_power_user(stack.envoy_url, scenario, api_keys=keys)
        with console.status("2/2 straight to the engine (FIFO)…"):
            direct = await run_power_user(stack.sim_url(model), scenario)
        console.print(comparison_table(summarize(gated), summarize(direct), scenario.flood_tenant))
        console.print(f"logs: {workdir}")
        if args.once:
            return 0
        example_key = next(iter(config.envoy.api_keys))
        console.print(
            f"\nThe gateway keeps running at [bold]{stack.envoy_url}[/] (models: "
            f"{', '.join(m.name for m in config.models)}; API keys: {', '.join(config.envoy.api_keys)}).\n"
            f"Try:  curl {stack.envoy_url}/v1/chat/completions -H 'Authorization: Bearer {example_key}' "
            f"-H 'content-type: application/json' -d '{{\"model\":\"{model}\",\"messages\":"
            f"[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'\n"
            f"Queue and engine metrics: {stack.metrics_url}    Ctrl-C stops everything."
        )
        await _wait_for_ctrl_c()
    return 0


def run_demo(args: argparse.Namespace) -> int:
    import uvloop

    return uvloop.run(_demo(args, Console()))
