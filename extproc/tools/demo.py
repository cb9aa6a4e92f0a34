"""``extproc-dev demo``: the power-user problem and its fix, on a real Envoy, in one command.

Starts two simulated vLLM engines, the processor and Envoy (the same stack the
integration tests use), replays the power-user scenario through the gateway
and then straight to the engine (its plain FIFO), prints both side by side,
and keeps the gateway up for the user's own requests until Ctrl-C.

Its ports are the config's, or ``--port-base N`` and the offsets in
:data:`PORT_OFFSETS`, so that it can run beside another demo, a compose stack
or a test run; a busy port is one line naming it. The logs go to a temporary
folder, removed at exit unless ``--keep`` or ``--workdir`` (or a failure,
which says where they are).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from extproc.adapters.config import load_config, split_address
from extproc.adapters.ports import bind_problem
from extproc.tools.power_user import PowerUser, TenantSummary, run_power_user, summarize

DEMO_CONFIG = resources.files("extproc") / "data" / "demo.yaml"
# A small GPU: 8 sequences per batch, so a 200-request flood is a real backlog.
SIM_ARGS = ["--max-num-seqs", "8", "--step-ms", "20", "--time-scale", "0.25"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEMO_CONFIG), help="extproc config (default: the packaged demo)")
    parser.add_argument("--once", action="store_true", help="exit after the comparison table")
    parser.add_argument("--flood", type=int, default=200, help="requests the power user sends (default 200)")
    parser.add_argument("--workdir", help="where logs go, kept at exit (default: a temporary folder, removed at exit)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder with the logs at exit")
    parser.add_argument(
        "--port-base", type=_port_base, metavar="N",
        help="move every port: Envoy N, its admin N+1, gRPC N+2, metrics N+3, engines N+10... "
        "(default: the config's ports; the packaged demo uses 10000, 9901, 50051, 9464, 8001-8002)",
    )


# Port of each listener relative to --port-base; engines take ENGINES_OFFSET, +1, ... in config order.
PORT_OFFSETS = {"envoy.listen": 0, "envoy.admin": 1, "listen.grpc": 2, "listen.metrics": 3}
ENGINES_OFFSET = 10
# Room for the engines of a demo-sized config above the base.
PORT_BASE_SPAN = 100


def _port_base(text: str) -> int:
    base = int(text)
    if not 1024 <= base <= 65535 - PORT_BASE_SPAN:
        raise argparse.ArgumentTypeError(f"must be a port in [1024, {65535 - PORT_BASE_SPAN}], got {base}")
    return base


def with_port_base(raw: dict[str, Any], base: int) -> dict[str, Any]:
    """The config document with every listener and engine endpoint moved to ``base`` + its offset (hosts kept)."""
    def moved(address: str, port: int) -> str:
        host, _, _ = address.rpartition(":")
        return f"{host}:{port}"

    doc = {**raw, "listen": dict(raw.get("listen") or {}), "envoy": dict(raw.get("envoy") or {})}
    for key, offset in PORT_OFFSETS.items():
        section, name = key.split(".")
        doc[section][name] = moved(doc[section].get(name, "127.0.0.1:0"), base + offset)
    port = base + ENGINES_OFFSET
    models = []
    for model in raw["models"]:
        endpoints = []
        for endpoint in model["endpoints"]:
            endpoints.append(moved(endpoint, port))
            port += 1
        models.append({**model, "endpoints": endpoints})
    doc["models"] = models
    return doc


def busy_port(config_path: Path) -> str | None:
    """One line naming the first of the demo's ports that cannot be listened on and how to move them, or None."""
    config = load_config(config_path)
    addresses = {"envoy.listen": config.envoy.listen, "envoy.admin": config.envoy.admin,
                 "listen.grpc": config.listen.grpc, "listen.metrics": config.listen.metrics}
    addresses.update((f"models[{i}].endpoints[{j}]", endpoint.split("://", 1)[1])
                     for i, model in enumerate(config.models) for j, endpoint in enumerate(model.endpoints))
    for key, address in addresses.items():
        problem = bind_problem(address)
        if problem is not None:
            return (f"port {split_address(address)[1]} ({key}) {problem}: stop what holds it, "
                    "or move every demo port with --port-base N")
    return None


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


async def _demo(args: argparse.Namespace, console: Console, workdir: Path) -> int:
    from extproc.tools.stack import start_stack

    config_path = Path(args.config)
    if args.port_base is not None:
        load_config(config_path)  # its mistakes named in the user's file, not in the rewritten copy
        raw = yaml.safe_load(config_path.read_text(encoding="utf-8"))
        config_path = workdir / "demo.yaml"
        config_path.write_text(yaml.safe_dump(with_port_base(raw, args.port_base), sort_keys=False), encoding="utf-8")
    busy = busy_port(config_path)
    if busy is not None:
        console.print(f"error: {busy}", style="red", highlight=False)
        return 1
    serve_args = ["--log-level", args.log_level, "--log-format", args.log_format]
    with console.status("starting simulators, extproc and Envoy…"):
        stack = await start_stack(config_path, workdir, sim_args=SIM_ARGS, serve_args=serve_args)
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
            f"Status page: http://{config.listen.metrics}/    metrics: {stack.metrics_url}    Ctrl-C stops everything.",
            soft_wrap=True,  # no line breaks inside the command to copy
        )
        console.file.flush()  # when piped (e.g. to tee), the user must see this now, not at exit
        await stop.wait()
    return 0


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo in its work folder; a temporary one is removed at exit unless kept or the demo failed."""
    import uvloop

    from extproc.tools.procs import ProcessStartError

    # Piped output (tee, CI logs) gets rich's 80 columns by default: too narrow for the table.
    console = Console() if sys.stdout.isatty() else Console(width=110)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="extproc-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    keep = bool(args.workdir or args.keep)
    try:
        code = uvloop.run(_demo(args, console, workdir))
    except ProcessStartError as exc:
        console.print(f"error: {exc}", highlight=False, markup=False)
        code = 1
    except BaseException:
        console.print(f"logs kept in {workdir}", highlight=False)
        raise
    if keep or (code != 0 and any(workdir.glob("*.log"))):
        console.print(f"logs {'kept ' if code == 0 else ''}in {workdir}", highlight=False)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return code
