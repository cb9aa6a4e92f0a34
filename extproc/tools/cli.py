"""Development command line: ``extproc-dev sim|demo|bench|autoscale|soak``.

The simulator, the demo and the benchmark, apart from ``extproc`` so that the
command an operator runs never imports them. Same conventions as ``extproc``
(:mod:`extproc.cli`): ``--log-level`` and ``--log-format`` before the command,
and one line per mistake with exit code 2 (config) or 1 (anything else,
no Envoy binary included), never a traceback.
"""

from __future__ import annotations

import argparse

from extproc.cli import command_parser, log_options_after, run
from extproc.tools.autoscale import add_arguments as add_autoscale_arguments
from extproc.tools.autoscale import run_autoscale
from extproc.tools.autoscale_sim import simulate_in_time
from extproc.tools.bench.cli import add_arguments as add_bench_arguments
from extproc.tools.bench.cli import run_bench
from extproc.tools.demo import add_arguments as add_demo_arguments
from extproc.tools.demo import run_demo
from extproc.tools.envoy_bin import EnvoyNotFound
from extproc.tools.sim import add_arguments as add_sim_arguments
from extproc.tools.sim import run as run_sim
from extproc.tools.soak import add_arguments as add_soak_arguments
from extproc.tools.soak import run as run_soak


def build_parser() -> argparse.ArgumentParser:
    parser, commands = command_parser("extproc-dev", __doc__.splitlines()[0],
                                      epilog="The gateway itself: extproc serve|check-config|envoy-config.")

    sim = commands.add_parser("sim", help="run the vLLM simulator (OpenAI API + vLLM /metrics)")
    add_sim_arguments(sim)
    sim.set_defaults(func=run_sim)

    demo = commands.add_parser("demo", parents=[log_options_after()],
                               help="run the power-user demo on a real Envoy, then keep serving")
    add_demo_arguments(demo)
    demo.set_defaults(func=run_demo)

    bench = commands.add_parser("bench", help="benchmark scenarios and the ext_proc overhead: tables and plots")
    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench)

    autoscale = commands.add_parser("autoscale", help="a simulated autoscaler on the demand series, under a day of load "
                                    "in minutes: lost requests, TTFT, engine-seconds")
    add_autoscale_arguments(autoscale)
    autoscale.set_defaults(func=lambda args: run_autoscale(args, simulate_in_time))
    soak = commands.add_parser("soak", help="mixed traffic for an hour: memory, descriptors, tasks and release "
                               "latency over time, with a plot")
    add_soak_arguments(soak)
    soak.set_defaults(func=run_soak)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv), EnvoyNotFound)
