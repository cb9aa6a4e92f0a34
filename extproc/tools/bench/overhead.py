"""The overhead benchmark: what the ext_proc hop adds, at real speed, measured with ``hey``.

Three paths to the same trivially fast upstream (an Envoy answering every
chat completion from memory with ``direct_response``, and ``/metrics`` with a
vLLM page that reports an idle engine):

* ``upstream``      — the load tool straight to it: the floor of this machine;
* ``envoy``         — through the gateway Envoy without ext_proc;
* ``envoy+null``    — through the same gateway Envoy as ``envoy+extproc``, to a
  processor that answers every message at once (null_processor.py) on the same
  transport: the hop's floor, Envoy's ext_proc filter and one gRPC round trip;
* ``envoy+extproc`` — through the gateway Envoy and the processor, whose gate
  is uncontended (``target_waiting`` far above any queue), so every request is
  held and released at once: the pure cost of the hop, on our metadata fast
  path (Envoy's json_to_metadata hands the processor the body's fields; the
  body never crosses the hop);
* ``envoy+extproc-grpcio`` — the same on the reference transport
  (``listen.transport: grpcio``, grpc.aio), for the transports' CPU per request;
* ``gie-buffered``, ``gie-duplex`` — the processor attached as a GIE Endpoint
  Picker, by ext_proc alone, in Envoy AI Gateway's shape
  (tools/gie_gateway.py's ``strict``, plaintext like the other paths), the
  bodies ``BUFFERED`` or ``FULL_DUPLEX_STREAMED``: the body crosses the hop
  both ways, the response too, and the processor parses the request's JSON.

All of them run side by side. Each gets a warm-up, then fixed-rate runs
(``hey -q``) and runs at the highest rate ``hey`` reaches with
``MAX_WORKERS`` connections, each split into ``ROUNDS`` short runs that
alternate between the paths, so a change in the machine's background load
hits every path alike; latencies are pooled over the rounds. ``hey`` (Debian
package ``hey``) is closed-loop per worker and its rate-limited workers tick
in step (k workers send bursts of k), so the fixed rate uses one worker: one
keep-alive connection sending a request every 1/300 s, which holds while
answers take less than that. The load tool, the Envoys and the processor
share the machine's cores: the max-rate figure is for this machine as a whole.

CPU per request is the processor's (and the gateway Envoy's) user + system
time during the run, from ``/proc``, divided by the requests completed. With
each transport's memory per held request (held.py), :func:`summarize_overhead`
puts both transports side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import functools
import io
import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from extproc.adapters.envoy import bootstrap
from extproc.tools import gie_gateway
from extproc.tools.bench.arms import MODEL, api_key
from extproc.tools.bench.held import HeldResult
from extproc.tools.bench.null_processor import start_null_processor
from extproc.tools.envoy_proc import start_envoy
from extproc.tools.power_user import percentile
from extproc.tools.procs import cpu_seconds, free_port
from extproc.tools.stack import Gateway, start_stack

FIXED_RATE = 300  # requests per second
# hey's workers tick in step, so k workers send bursts of k: one worker paces
# its requests evenly (as long as each answer comes within 1/FIXED_RATE).
FIXED_WORKERS = 1
MAX_WORKERS = 32
# Each measurement is split into rounds that alternate between the paths.
ROUNDS = 5
TENANT = "bench"
_TYPE = "type.googleapis.com/"
_CHAT_RESPONSE = json.dumps({
    "id": "chatcmpl-fast", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
})


def idle_engine_metrics(model: str) -> str:
    """A vLLM ``/metrics`` page of an idle engine serving ``model``: nothing waiting, nothing running."""
    return "".join(
        f"# TYPE {name} gauge\n{name}{{model_name=\"{model}\"}} 0\n"
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running")
    )


REQUEST_BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})


class HeyMissing(RuntimeError):
    """The load tool is not installed; the message says how to install it."""


def find_hey() -> str:
    found = shutil.which("hey")
    if found is None:
        raise HeyMissing(
            "the overhead benchmark needs the load tool `hey`: `apt-get install hey` (Debian/Ubuntu), "
            "or run `extproc-dev bench --no-overhead`"
        )
    return found


@dataclass(frozen=True)
class HeyRun:
    sent: int
    ok: int
    seconds: float
    latencies_s: tuple[float, ...]  # of the successful requests

    @property
    def rate(self) -> float:
        return self.ok / self.seconds


def parse_hey_csv(text: str, seconds: float) -> HeyRun:
    """``hey -o csv`` rows: response-time, …, status-code, offset (seconds)."""
    rows = list(csv.DictReader(io.StringIO(text)))
    ok = [float(r["response-time"]) for r in rows if r["status-code"] == "200"]
    return HeyRun(sent=len(rows), ok=len(ok), seconds=seconds, latencies_s=tuple(ok))


async def run_hey(url: str, *, seconds: float, workers: int, rate_per_worker: float | None = None) -> HeyRun:
    argv = [
        find_hey(), "-z", f"{seconds:g}s", "-c", str(workers), "-m", "POST", "-T", "application/json",
        "-H", f"authorization: Bearer {api_key(TENANT)}", "-d", REQUEST_BODY, "-o", "csv",
    ]
    if rate_per_worker is not None:
        argv += ["-q", f"{rate_per_worker:g}"]
    process = await asyncio.create_subprocess_exec(
        *argv, f"{url}/v1/chat/completions", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"hey failed ({process.returncode}): {err.decode()[-500:]}")
    return parse_hey_csv(out.decode(), seconds)


def upstream_bootstrap(listen_port: int, admin_port: int) -> dict[str, Any]:
    """An Envoy that answers chat completions and ``/metrics`` from memory: the fastest possible engine."""

    def reply(body: str, content_type: str) -> dict[str, Any]:
        return {
            "direct_response": {"status": 200, "body": {"inline_string": body}},
            "response_headers_to_add": [
                {
                    "header": {"key": "content-type", "value": content_type},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                }
            ],
        }

    hcm = {
        "@type": _TYPE + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "upstream",
        "route_config": {
            "virtual_hosts": [{
                "name": "fast",
                "domains": ["*"],
                "routes": [
                    {"match": {"path": "/metrics"}, **reply(idle_engine_metrics(MODEL), "text/plain; version=0.0.4")},
                    {"match": {"prefix": "/"}, **reply(_CHAT_RESPONSE, "application/json")},
                ],
            }]
        },
        "http_filters": [{
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": _TYPE + "envoy.extensions.filters.http.router.v3.Router"},
        }],
    }
    listener = {
        "name": "upstream",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
        ],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {"listeners": [listener]},
    }


def overhead_config(upstream_url: str, *, endpoint_picking: bool = False, transport: str = "builtin") -> dict[str, Any]:
    """An extproc config whose gate never holds: the queue is far below ``target_waiting``.

    ``endpoint_picking`` for the GIE paths: their Envoy routes to the endpoint the processor names.
    """
    return {
        "listen": {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}", "transport": transport},
        "models": [{
            "name": MODEL,
            "endpoints": [upstream_url],
            "target_waiting": 1_000_000,
            "advanced": {"fallback_max_in_flight": 1_000_000},
            "endpoint_picking": endpoint_picking,
        }],
        "envoy": {
            "listen": f"127.0.0.1:{free_port()}",
            "admin": f"127.0.0.1:{free_port()}",
            "api_keys": {api_key(TENANT): TENANT},
            # The admission bucket out of the way: this measures the hop at full speed, not the shedding.
            "admission_burst": 1_000_000,
            "admission_per_second": 1_000_000,
        },
    }


# The paths behind Envoy: name, what runs behind it ("null": null_processor.py behind our ext_proc
# filter), the GIE gateway shape's body mode (None: our bootstrap), and the processor's transport
# (listen.transport).
PATHS: tuple[tuple[str, Gateway | Literal["null"], gie_gateway.BodyMode | None, str], ...] = (
    ("envoy", "envoy", None, "builtin"),
    ("envoy+null", "null", None, "builtin"),
    ("envoy+extproc", "extproc", None, "builtin"),
    ("envoy+extproc-grpcio", "extproc", None, "grpcio"),
    ("gie-buffered", "extproc", "buffered", "builtin"),
    ("gie-duplex", "extproc", "duplex", "builtin"),
)
# Each path with a processor, compared with Envoy alone (summarize_overhead's added_ms).
PROCESSOR_PATHS = tuple(path for path, gateway, _, _ in PATHS if gateway == "extproc")
# The hop as deployed by default (our Envoy, the metadata fast path, the h2 transport): the path the
# hop's own figures (extproc_*) and the report's targets are read from.
FAST_PATH = "envoy+extproc"
# The hop with a processor that only says CONTINUE: what FAST_PATH costs without our scheduler.
FLOOR_PATH = "envoy+null"
# The metadata fast path on each transport: the two compared in summarize_overhead's "transports".
TRANSPORT_PATHS = {"builtin": FAST_PATH, "grpcio": "envoy+extproc-grpcio"}


@dataclass(frozen=True)
class PathResult:
    path: str
    fixed: tuple[HeyRun, ...]  # one per round
    max: tuple[HeyRun, ...]
    # CPU microseconds per completed request, per process, over all fixed / max runs.
    cpu_us_fixed: dict[str, float]
    cpu_us_max: dict[str, float]


@dataclass(frozen=True)
class _Target:
    path: str
    url: str
    pids: dict[str, int]


async def _rounds(
    targets: list[_Target], rounds: int, seconds: float, on_step: Callable[[str], None], **hey: Any
) -> tuple[dict[str, list[HeyRun]], dict[str, dict[str, float]]]:
    """``rounds`` runs per target, interleaved (the order rotates), so a change in the machine's
    background load during the benchmark hits every path alike."""
    runs: dict[str, list[HeyRun]] = {t.path: [] for t in targets}
    cpu: dict[str, dict[str, float]] = {t.path: dict.fromkeys(t.pids, 0.0) for t in targets}
    for i in range(rounds):
        for target in targets[i % len(targets):] + targets[: i % len(targets)]:
            before = {name: cpu_seconds(pid) for name, pid in target.pids.items()}
            runs[target.path].append(await run_hey(target.url, seconds=seconds, **hey))
            for name, pid in target.pids.items():
                cpu[target.path][name] += cpu_seconds(pid) - before[name]
        on_step(f"round {i + 1}/{rounds}")
    per_request = {
        path: {name: used * 1e6 / max(1, sum(r.ok for r in runs[path])) for name, used in cpu[path].items()}
        for path in runs
    }
    return runs, per_request


async def run_overhead(
    workdir: Path, *, seconds: float = 10.0, rounds: int = ROUNDS, on_step: Callable[[str], None] = lambda label: None
) -> list[PathResult]:
    """Measure the paths (see module docstring): ``seconds`` per path and mode, in ``rounds`` rounds."""
    find_hey()
    workdir.mkdir(parents=True, exist_ok=True)
    up_port = free_port()
    async with contextlib.AsyncExitStack() as running:
        upstream = await start_envoy(upstream_bootstrap(up_port, free_port()), workdir / "upstream")
        await running.enter_async_context(upstream)
        upstream_url = f"http://127.0.0.1:{up_port}"
        targets = [_Target("upstream", upstream_url, {})]
        for path, gateway, shape, transport in PATHS:
            folder = workdir / path
            folder.mkdir(exist_ok=True)
            config_path = folder / "config.yaml"
            config = overhead_config(upstream_url, endpoint_picking=shape is not None, transport=transport)
            config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
            envoy_bootstrap = None if shape is None else functools.partial(gie_gateway.strict, model=MODEL, body=shape)
            null = None
            if gateway == "null":
                null = await running.enter_async_context(await start_null_processor(
                    config["listen"]["grpc"], MODEL, folder / "null.log"))
                envoy_bootstrap = functools.partial(bootstrap, ext_proc=True)
            stack = await running.enter_async_context(await start_stack(
                config_path, folder, gateway="envoy" if gateway == "null" else gateway, engines=False,
                envoy_bootstrap=envoy_bootstrap,
            ))
            assert stack.envoy is not None
            pids = {"envoy": stack.envoy.process.pid}
            if stack.processor is not None:
                pids["extproc"] = stack.processor.process.pid
            if null is not None:
                pids["null"] = null.process.pid
            targets.append(_Target(path, stack.envoy_url, pids))
        for target in targets:  # warm-up: connections, caches
            await run_hey(target.url, seconds=min(1.0, seconds), workers=8, rate_per_worker=50)
        share = seconds / rounds
        fixed, cpu_fixed = await _rounds(
            targets, rounds, share, on_step, workers=FIXED_WORKERS, rate_per_worker=FIXED_RATE / FIXED_WORKERS
        )
        fastest, cpu_max = await _rounds(targets, rounds, share, on_step, workers=MAX_WORKERS)
    return [
        PathResult(t.path, tuple(fixed[t.path]), tuple(fastest[t.path]), cpu_fixed[t.path], cpu_max[t.path])
        for t in targets
    ]


def latency_ms(latencies: Sequence[float]) -> dict[str, float | None]:
    return {q: (percentile(latencies, n) * 1000 if latencies else None) for q, n in (("p50", 50), ("p99", 99))}


def _pooled(runs: Sequence[HeyRun]) -> dict[str, Any]:
    latencies = [x for run in runs for x in run.latencies_s]
    seconds = sum(run.seconds for run in runs)
    ok = sum(run.ok for run in runs)
    return {"rate": ok / seconds, "sent": sum(run.sent for run in runs), "ok": ok, **latency_ms(latencies)}


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def summarize_overhead(paths: list[PathResult], held: list[HeldResult] | None = None) -> dict[str, Any]:
    """Per path: rates, latency percentiles (pooled over rounds) and CPU per request; then what each processor
    path adds; then each transport's CPU per request and (from ``held``) memory per held request."""
    by_path = {
        p.path: {
            "fixed": _pooled(p.fixed),
            "max": _pooled(p.max),
            "cpu_us_per_request_fixed": p.cpu_us_fixed,
            "cpu_us_per_request_max": p.cpu_us_max,
        }
        for p in paths
    }
    summary: dict[str, Any] = {
        "fixed_rate": FIXED_RATE, "max_workers": MAX_WORKERS, "rounds": len(paths[0].fixed) if paths else 0,
        "paths": by_path,
    }
    runs = {p.path: p for p in paths}
    if "envoy" in runs:
        # What each processor path adds to Envoy alone, at the fixed rate: the same hop in its attachments.
        summary["added_ms"] = {
            path: {q: _difference(by_path[path]["fixed"][q], by_path["envoy"]["fixed"][q]) for q in ("p50", "p99")}
            for path in PROCESSOR_PATHS if path in runs
        }
    if "envoy" in runs and FAST_PATH in runs:
        alone, hop = by_path["envoy"], by_path[FAST_PATH]
        summary["extproc_added_ms"] = {q: _difference(hop["fixed"][q], alone["fixed"][q]) for q in ("p50", "p99")}
        # The same difference round by round shows how much the machine's background moved it.
        summary["extproc_added_p50_ms_by_round"] = [
            _difference(latency_ms(b.latencies_s)["p50"], latency_ms(a.latencies_s)["p50"])
            for a, b in zip(runs["envoy"].fixed, runs[FAST_PATH].fixed, strict=True)
        ]
        summary["extproc_max_rate"] = hop["max"]["rate"]
        # Both at saturation, in the same rounds: the share of Envoy's own rate the hop leaves.
        summary["extproc_rate_vs_envoy"] = hop["max"]["rate"] / alone["max"]["rate"] if alone["max"]["rate"] else None
        summary["extproc_cpu_us_per_request"] = hop["cpu_us_per_request_fixed"]["extproc"]
        summary["extproc_cpu_us_per_request_max"] = hop["cpu_us_per_request_max"]["extproc"]
    if "envoy" in runs and FLOOR_PATH in runs:
        # The hop's floor beside the real processor's figures: how much of the hop is not the scheduler.
        alone, floor = by_path["envoy"], by_path[FLOOR_PATH]
        summary["floor"] = {
            "added_ms": {q: _difference(floor["fixed"][q], alone["fixed"][q]) for q in ("p50", "p99")},
            "added_p50_ms_by_round": [
                _difference(latency_ms(b.latencies_s)["p50"], latency_ms(a.latencies_s)["p50"])
                for a, b in zip(runs["envoy"].fixed, runs[FLOOR_PATH].fixed, strict=True)
            ],
            "cpu_us_per_request": floor["cpu_us_per_request_fixed"]["null"],
            "cpu_us_per_request_max": floor["cpu_us_per_request_max"]["null"],
            "max_rate": floor["max"]["rate"],
        }
    memory = {h.transport: h.summary() for h in held or ()}
    transports = {
        transport: {
            **({} if path not in by_path else {
                "cpu_us_per_request_fixed": by_path[path]["cpu_us_per_request_fixed"]["extproc"],
                "cpu_us_per_request_max": by_path[path]["cpu_us_per_request_max"]["extproc"],
                "max_rate": by_path[path]["max"]["rate"],
                "added_p50_ms": summary.get("added_ms", {}).get(path, {}).get("p50"),
            }),
            **memory.get(transport, {}),
        }
        for transport, path in TRANSPORT_PATHS.items()
    }
    if any(transports.values()):
        summary["transports"] = {t: figures for t, figures in transports.items() if figures}
    return summary
