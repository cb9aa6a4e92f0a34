"""Command line entry point: ``extproc serve|check-config|envoy-config|usage``.

Only what an operator runs in production: the command imports the adapters and
never the development tools (the simulator, the demo and the benchmark are
``extproc-dev``, :mod:`extproc.tools.cli`, built on the helpers here). The gRPC
server is imported only when ``serve`` is chosen, so ``check-config`` and
``envoy-config`` start without loading gRPC.

What an operator gets wrong (a config mistake, a busy port, no Envoy binary)
ends in one line per mistake on stderr and a non-zero exit code, never a
traceback: 2 for a config that cannot be used, 1 for the rest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from extproc.adapters.config import Config, ConfigError, load_config
from extproc.adapters.logs import FORMATS, LEVELS, setup_logging
from extproc.adapters.ports import bind_problem


class CannotStart(RuntimeError):
    """The command cannot run as asked; the message is the one line the user reads."""


def _serve(args: argparse.Namespace) -> int:
    import uvloop

    from extproc.adapters.reload import ConfigSource
    from extproc.adapters.server import serve

    # Read once: SIGHUP reloads the same file, compared with this content (adapters/reload.py).
    source = ConfigSource(Path(args.config), args.shard, args.instance)
    text = source.read()
    config, _ = source.load(text)
    batches = () if config.batches is None else (("batches.listen", config.batches.listen),)
    for key, address in (("listen.grpc", config.listen.grpc), ("listen.metrics", config.listen.metrics), *batches):
        problem = bind_problem(address)
        if problem is not None:
            raise CannotStart(f"{key}: {address} {problem} (set {key} to a free address)")
    try:
        uvloop.run(serve(config, args.drain_seconds, args.deadline_seconds, (source, text), args.watch_config))
    except OSError as exc:  # a bind lost a race with another process since the check above
        raise CannotStart(f"cannot listen: {exc} (listen.grpc {config.listen.grpc}, "
                          f"listen.metrics {config.listen.metrics})") from exc
    return 0


def _check_config(args: argparse.Namespace) -> int:
    """Every mistake in every file, as serve and envoy-config would find them; nothing is started.

    With ``--explain``, each valid file's effective configuration follows its
    ok line, one key per line with its source (adapters/config/explain.py);
    with ``--format json``, one JSON document of them by file instead.
    """
    from extproc.adapters.config.explain import explain

    failed = False
    explained: dict[str, list[dict[str, Any]]] = {}
    for path in args.files:
        try:
            config = load_config(path)
            problems = config.envoy_problems()
            if problems:
                raise ConfigError(*(f"{path}: {problem}" for problem in problems))
        except ConfigError as exc:
            failed = True
            for error in exc.errors:
                print(f"error: {error}", file=sys.stderr)
            continue
        wanted = args.explain or args.format == "json"
        lines = explain(yaml.safe_load(Path(path).read_text(encoding="utf-8")), config) if wanted else []
        if args.format == "json":
            explained[path] = [{"key": line.key, "value": line.value, "source": line.source, "from": line.note}
                               for line in lines]
            continue
        print(f"{path}: ok ({len(config.models)} model(s): {', '.join(m.name for m in config.models)})")
        for line in lines:
            print(f"  {line.text()}")
    if args.format == "json":
        print(json.dumps(explained, indent=1))
    return 2 if failed else 0


def _envoy_config(args: argparse.Namespace) -> int:
    """`extproc envoy-config --config FILE [--drop-in | --into ENVOY.yaml]`: YAML on stdout."""
    from extproc.adapters.envoy import render

    config = load_config(args.config)
    try:
        doc, header = _envoy_document(args, config)
    except ConfigError as exc:
        raise ConfigError(*(f"{args.config}: {error}" for error in exc.errors)) from exc
    sys.stdout.write(render(doc, header=header))
    return 0


def _envoy_document(args: argparse.Namespace, config: Config) -> tuple[dict[str, Any], str]:
    """The document the arguments ask for, with its header."""
    from extproc.adapters.envoy import DROP_IN_HEADER, HEADER, INTO_HEADER, LLM_PREFIXES, bootstrap, drop_in, merge_checked

    if not (args.drop_in or args.into):
        return bootstrap(config), HEADER
    prefixes = tuple(args.llm_prefix or LLM_PREFIXES)
    bad = [p for p in prefixes if not p.startswith("/")]
    if bad:
        raise ConfigError(*(f"--llm-prefix {p!r}: must start with /" for p in bad))
    piece = drop_in(config, prefixes=prefixes, existing_clusters=_existing_clusters(args.cluster))
    if args.drop_in:
        return piece, DROP_IN_HEADER
    try:
        with open(args.into, encoding="utf-8") as handle:
            existing = yaml.safe_load(handle)
        if not isinstance(existing, dict):
            raise ConfigError("not an Envoy bootstrap (a YAML mapping)")
        merged = merge_checked(existing, piece, listener=args.listener, virtual_host=args.virtual_host)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{args.into}: {exc}") from exc
    except ConfigError as exc:
        raise ConfigError(*(f"{args.into}: {error}" for error in exc.errors)) from exc
    return merged, INTO_HEADER.format(path=args.into)


def _usage(args: argparse.Namespace) -> int:
    """`extproc usage --config FILE [--since DAY] [--per day|month] [--format csv|json] [--store]`: usage on stdout.

    With ``cluster:``, the cluster's rows in its Redis (every instance's charges); else, or with ``--store``,
    this instance's ``budgets.store`` file.
    """
    from extproc.adapters.budgets.usage import records, render, since_day

    config = load_config(args.config)
    try:
        since = since_day(args.since)
    except ValueError as exc:
        raise CannotStart(str(exc)) from exc
    if config.budgets is not None and config.cluster is not None and not args.store:
        rows = _cluster_usage(config, since)
    else:
        rows = _stored_usage(args.config, config, since)
    sys.stdout.write(render(records(rows, args.per), args.format))
    return 0


def _cluster_usage(config: Config, since: str) -> list[Any]:
    """The cluster's usage rows from ``since`` (YYYY-MM-DD), read from its Redis."""
    import asyncio
    import time

    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    from extproc.adapters.budgets import cluster_usage
    from extproc.core.budgets.book import day_of

    assert config.cluster is not None
    cluster = config.cluster

    async def read() -> list[Any]:
        client = aioredis.from_url(cluster.redis_url, socket_connect_timeout=5, socket_timeout=10)
        try:
            return await cluster_usage.rows(client, f"{cluster.key_prefix}:budget", day_of(since), time.time(), 30)
        finally:
            await client.aclose()

    try:
        return asyncio.run(read())
    except (RedisError, OSError, TimeoutError) as exc:
        raise CannotStart(f"cluster.redis_url: cannot read the cluster's usage ({str(exc) or 'timeout'}); "
                          "an instance's own: --store") from exc


def _stored_usage(path: str, config: Config, since: str) -> list[Any]:
    """This instance's usage rows from ``since`` (YYYY-MM-DD), read from its ``budgets.store``."""
    import sqlite3

    from extproc.adapters.budgets.usage_store import UsageStore

    store = None if config.budgets is None else config.budgets.store
    if store is None:
        raise CannotStart(f"{path}: budgets.store is not set: ask the running processor (GET /usage on its "
                          "metrics port)")
    if not Path(store).exists():
        raise CannotStart(f"budgets.store: {store} does not exist (yet): the processor writes it")
    try:
        return UsageStore(store).rows(since)
    except sqlite3.Error as exc:
        raise CannotStart(f"budgets.store: cannot read {store} ({exc})") from exc


def _existing_clusters(pairs: list[str]) -> dict[str, str]:
    result: dict[str, str] = {}
    for pair in pairs:
        model, sep, cluster = pair.partition("=")
        if not sep or not model or not cluster:
            raise ConfigError(f"--cluster {pair!r}: expected MODEL=CLUSTER")
        result[model] = cluster
    return result


def _envoy_arguments(parser: argparse.ArgumentParser) -> None:
    from extproc.adapters.envoy import LLM_PREFIXES

    parser.add_argument("--config", required=True, metavar="FILE", help="extproc YAML configuration")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--drop-in", action="store_true",
                      help="print the filters, routes and clusters to merge into an existing Envoy (see --into)")
    mode.add_argument("--into", metavar="ENVOY.yaml",
                      help="print ENVOY.yaml (a static bootstrap) with the drop-in merged in and validated")
    parser.add_argument("--llm-prefix", action="append", metavar="PATH",
                        help=f"a path prefix the drop-in schedules (repeatable; default: {' '.join(LLM_PREFIXES)})")
    parser.add_argument("--cluster", action="append", default=[], metavar="MODEL=CLUSTER",
                        help="route MODEL to a cluster your Envoy already has instead of generating one (repeatable)")
    parser.add_argument("--listener", metavar="NAME", help="with --into: the listener to merge into (if several)")
    parser.add_argument("--virtual-host", metavar="NAME", help="with --into: the virtual host for the routes (if several)")


def _log_options(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--log-format``: before the command, and after those that take them (serve, demo)."""
    parser.add_argument("--log-level", choices=LEVELS,
                        help="debug adds one decision line per queued request (default info)")
    parser.add_argument("--log-format", choices=FORMATS,
                        help="json: one JSON object per line (ts, level, logger, msg, fields; default text)")


def log_options_after() -> argparse.ArgumentParser:
    """A parent parser for a command that takes ``--log-level`` and ``--log-format`` after its name too.

    Options not given after the command leave what was given before it.
    """
    after = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    _log_options(after)
    return after


def command_parser(
    prog: str, description: str, epilog: str | None = None
) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction[argparse.ArgumentParser]]:
    """A parser with the log options before the command, and the action each command is added to."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog)
    _log_options(parser)
    parser.set_defaults(log_level="info", log_format="text")
    return parser, parser.add_subparsers(dest="command", required=True)


def build_parser() -> argparse.ArgumentParser:
    parser, commands = command_parser(
        "extproc", __doc__.splitlines()[0],
        epilog="The simulator, the demo and the benchmark: extproc-dev sim|demo|bench.",
    )
    serve = commands.add_parser("serve", parents=[log_options_after()], help="run the ext_proc fair-queueing server")
    serve.add_argument("--config", required=True, help="YAML configuration file")
    serve.add_argument(
        "--drain-seconds", type=float, default=30.0,
        help="on SIGTERM, how long queued requests keep being released before the rest get 503 (default 30); "
        "also how long a model a reload removes keeps releasing what it holds",
    )
    serve.add_argument(
        "--watch-config", action="store_true",
        help="reload the config when the file's content changes (checked every second), as SIGHUP does "
        "(docs/configuration.md#reloading)",
    )
    serve.add_argument(
        "--deadline-seconds", type=float, default=600.0,
        help="on SIGTERM, the hard deadline: the process exits this long after it even if responses still "
        "stream (they go on through Envoy without the processor; default 600)",
    )
    serve.add_argument(
        "--shard", metavar="NAME",
        help="with a shards: section, the shard this instance is: it listens on the shard's addresses and "
        "schedules only the shard's models (docs/cluster.md)",
    )
    serve.add_argument(
        "--instance", metavar="NAME",
        help="with cluster.instances (active-active), the instance this is: it listens on the instance's "
        "addresses instead of listen: (docs/cluster.md)",
    )
    serve.set_defaults(func=_serve)

    check = commands.add_parser("check-config", help="validate config files: every mistake with file, line and key")
    check.add_argument("files", nargs="+", metavar="FILE", help="YAML configuration file")
    check.add_argument("--explain", action="store_true",
                       help="print each file's effective configuration, one key per line with where its value came "
                       "from: set, default, derived (from what) or engine (read from the engine at run time)")
    check.add_argument("--format", choices=("text", "json"), default="text",
                       help="json: the --explain lines (implied) as one JSON document by file (key, value, source, from)")
    check.set_defaults(func=_check_config)

    envoy = commands.add_parser("envoy-config", help="print an Envoy bootstrap (or --drop-in pieces) for a config")
    _envoy_arguments(envoy)
    envoy.set_defaults(func=_envoy_config)

    usage = commands.add_parser("usage", help="print what each tenant used per model and day (with cluster:, the "
                                "cluster's, from Redis; else budgets.store), as CSV or JSON (docs/budgets.md)")
    usage.add_argument("--config", required=True, metavar="FILE",
                       help="YAML configuration file (its cluster.redis_url or budgets.store)")
    usage.add_argument("--store", action="store_true", help="with cluster: this instance's budgets.store instead")
    usage.add_argument("--since", default="1970-01-01", metavar="DAY", help="the first day, YYYY-MM-DD or YYYY-MM")
    usage.add_argument("--per", choices=("day", "month"), default="day", help="one row per day or per month")
    usage.add_argument("--format", choices=("csv", "json"), default="csv")
    usage.set_defaults(func=_usage)
    return parser


def run(args: argparse.Namespace, *cannot_start: type[Exception]) -> int:
    """Run the parsed command: its exit code, or one line per mistake on stderr and 2 (config) or 1.

    ``cannot_start`` are further exceptions that mean "cannot run as asked" (as :class:`CannotStart`).
    """
    setup_logging(args.log_level, args.log_format)
    failures: tuple[type[Exception], ...] = (CannotStart, *cannot_start)
    try:
        code: int = args.func(args)
        return code
    except ConfigError as exc:
        for error in exc.errors:
            print(f"error: {error}", file=sys.stderr)
        return 2
    except failures as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
