"""Command line entry point: ``extproc serve|sim|envoy-config|demo|bench``.

The gRPC server and the demo runtime are imported only when chosen, so
``extproc sim`` and ``extproc envoy-config`` start without loading gRPC.
"""

from __future__ import annotations

import argparse
import logging
import sys

from extproc.adapters.config import ConfigError, load_config


def _serve(args: argparse.Namespace) -> int:
    import uvloop

    from extproc.adapters.server import serve

    config = load_config(args.config)
    uvloop.run(serve(config, args.drain_seconds, args.deadline_seconds))
    return 0


def _sim(args: argparse.Namespace) -> int:
    from extproc.tools.sim.server import run

    return run(args)


def _envoy_config(args: argparse.Namespace) -> int:
    from extproc.adapters.envoy_config import main_envoy_config

    return main_envoy_config(args)


def _demo(args: argparse.Namespace) -> int:
    from extproc.tools.demo import run_demo

    return run_demo(args)


def _bench(args: argparse.Namespace) -> int:
    from extproc.tools.bench.cli import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="extproc", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the ext_proc fair-queueing server")
    serve.add_argument("--config", required=True, help="YAML configuration file")
    serve.add_argument(
        "--drain-seconds", type=float, default=30.0,
        help="on SIGTERM, how long queued requests keep being released before the rest get 503 (default 30)",
    )
    serve.add_argument(
        "--deadline-seconds", type=float, default=600.0,
        help="on SIGTERM, the hard deadline: the process exits this long after it even if responses still "
        "stream (they go on through Envoy without the processor; default 600)",
    )
    serve.set_defaults(func=_serve)

    from extproc.tools.sim.server import add_arguments as add_sim_arguments

    sim = commands.add_parser("sim", help="run the vLLM simulator (OpenAI API + vLLM /metrics)")
    add_sim_arguments(sim)
    sim.set_defaults(func=_sim)

    from extproc.adapters.envoy_config import add_arguments as add_envoy_arguments

    envoy = commands.add_parser("envoy-config", help="print an Envoy bootstrap (or --drop-in pieces) for a config")
    add_envoy_arguments(envoy)
    envoy.set_defaults(func=_envoy_config)

    from extproc.tools.demo import add_arguments as add_demo_arguments

    demo = commands.add_parser("demo", help="run the power-user demo on a real Envoy, then keep serving")
    add_demo_arguments(demo)
    demo.set_defaults(func=_demo)

    from extproc.tools.bench.cli import add_arguments as add_bench_arguments

    bench = commands.add_parser("bench", help="benchmark scenarios and the ext_proc overhead: tables and plots")
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        code: int = args.func(args)
        return code
    except ConfigError as exc:
        for error in exc.errors:
            print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
