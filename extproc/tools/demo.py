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
import sys
import tempfile
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.table import Table

from extproc.tools.power_user import PowerUser, TenantSummary, run_power_user, summarize

DEMO_CONFIG = resources.files("extproc") / "data" / "demo.yaml"
# A small GPU: 8 sequences per batch, so a 200-request flood is a real backlog.
SIM_ARGS = ["--max-num-seqs", "8", "--step-ms", "20", "--time-scale", "0.25"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEMO_CONFIG), help="extproc config (default: the packaged demo)")
    parser.add_argument("--once", action="store_true", help="exit after the comparison table")
    parser.add_argument("--flood", type=int, default=200, help="requests the power user sends (default 200)")
    parser.add_argument("--workdir", help="where logs go (default: a new temporary folder)")


def _duration(seconds: float) -> str:
    if seconds != seconds:  # NaN: nothing measured (no gateway in the direct run)
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _pair(p50: float, p99: float) -> str:
    return f"{_duration(p50)} / {_duration(p99)}"


def comparison_table(gated: list[TenantSummary], direct: list[TenantSummary], flood_tenant: str) -> Table:
    table = Table(title="Same load, through the gateway vs. straight to the engine (p50 / p99)")
    table.add_column("tenant")
    table.add_column("ok", justify="right")
    table.add_column("gateway\nqueue wait", justify="right")
    table.add_column("gateway\nfirst token", justify="right")
    table.add_column("direct FIFO\nfirst token", justify="right")
    direct_by_tenant = {s.tenant: s for s in direct}
    for s in gated:
        d = direct_by_tenant[s.tenant]
        role = "power user" if s.tenant == flood_tenant else "newcomer"
        table.add_row(
            f"{s.tenant} ({role})", f"{s.ok}/{s.requests}", _pair(s.wait_p50, s.wait_p99),
            _pair(s.ttft_p50, s.ttft_p99), _pair(d.ttft_p50, d.ttft_p99),
        )
    return table


def _newcomer_speedup(gated: list[TenantSummary], direct: list[TenantSummary], scenario: PowerUser) -> float:
    """Direct-FIFO over gateway time to first token, summed over the newcomers."""
    def total(summaries: list[TenantSummary]) -> float:
        return sum(s.ttft_p50 for s in summaries if s.tenant in scenario.newcomers)

    return total(direct) / total(gated)


def _ctrl_c() -> asyncio.Event:
    """An event set by Ctrl-C or SIGTERM; installed before the prompt, so an early signal is not lost."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _demo(args: argparse.Namespace, console: Console) -> int:
    from extproc.tools.stack import start_stack

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
        gated_summary, direct_summary = summarize(gated), summarize(direct)
        console.print(comparison_table(gated_summary, direct_summary, scenario.flood_tenant))
        speedup = _newcomer_speedup(gated_summary, direct_summary, scenario)
        console.print(f"Newcomers got their first token [bold]{speedup:.0f}x[/] sooner through the gateway.")
        console.print(f"logs: {workdir}")
        if args.once:
            return 0
        stop = _ctrl_c()
        example_key = next(iter(config.envoy.api_keys))
        console.print(
            f"\nThe gateway keeps running at [bold]{stack.envoy_url}[/] (models: "
            f"{', '.join(m.name for m in config.models)}; API keys: {', '.join(config.envoy.api_keys)}).\n"
            f"Try:  curl {stack.envoy_url}/v1/chat/completions -H 'Authorization: Bearer {example_key}' "
            f"-H 'content-type: application/json' -d '{{\"model\":\"{model}\",\"messages\":"
            f"[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'\n"
            f"Queue and engine metrics: {stack.metrics_url}    Ctrl-C stops everything.",
            soft_wrap=True,  # no line breaks inside the command to copy
        )
        console.file.flush()  # when piped (e.g. to tee), the user must see this now, not at exit
        await stop.wait()
    return 0


def run_demo(args: argparse.Namespace) -> int:
    import uvloop

    # Piped output (tee, CI logs) gets rich's 80 columns by default: too narrow for the table.
    console = Console() if sys.stdout.isatty() else Console(width=110)
    return uvloop.run(_demo(args, console))
