"""The overhead benchmark: what the ext_proc hop adds, at real speed, measured with ``hey``.

Three paths to the same trivially fast upstream (an Envoy answering every
chat completion from memory with ``direct_response``, and ``/metrics`` with a
vLLM page that reports an idle engine):

* ``upstream``      — the load tool straight to it: the floor of this machine;
* ``envoy``         — through the gateway Envoy without ext_proc;
* ``envoy+extproc`` — through the gateway Envoy and the processor, whose gate
  is uncontended (``target_waiting`` far above any queue), so every request is
  held and released at once: the pure cost of the hop.

Each path gets a warm-up, a fixed-rate run (``hey -q``: workers x rate per
worker) and a run at the highest rate ``hey`` reaches with ``MAX_WORKERS``
connections. ``hey`` (Debian package ``hey``) is closed-loop per worker and
its rate-limited workers tick in step (k workers send bursts of k), so the
fixed rate uses one worker: one keep-alive connection sending a request every
1/300 s, which holds while answers take less than that. The load tool, both Envoys and the processor share
the machine's cores; the max-rate figure is for this machine as a whole.

CPU per request is the processor's (and the gateway Envoy's) user + system
time during the run, from ``/proc``, divided by the requests completed.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from extproc.bench.arms import MODEL, api_key, free_port
from extproc.envoy_proc import EnvoyProcess, start_envoy
from extproc.procs import cpu_seconds
from extproc.scenario import percentile
from extproc.stack import Stack, start_stack

FIXED_RATE = 300  # requests per second
# hey's workers tick in step, so k workers send bursts of k: one worker paces
# its requests evenly (as long as each answer comes within 1/FIXED_RATE).
FIXED_WORKERS = 1
MAX_WORKERS = 32
TENANT = "bench"
_TYPE = "type.googleapis.com/"
_CHAT_RESPONSE = json.dumps({
    "id": "chatcmpl-fast", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
})
_IDLE_ENGINE_METRICS = "".join(
    f"# TYPE {name} gauge\n{name}{{model_name=\"{MODEL}\"}} 0\n"
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
            "or run `extproc bench --no-overhead`"
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
                {"header": {"key": "content-type", "value": content_type}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
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
                    {"match": {"path": "/metrics"}, **reply(_IDLE_ENGINE_METRICS, "text/plain; version=0.0.4")},
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
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {"listeners": [listener]},
    }


def overhead_config(upstream_url: str) -> dict[str, Any]:
    """An extproc config whose gate never holds: the queue is far below ``target_waiting``."""
    return {
        "listen": {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"},
        "models": [{
            "name": MODEL,
            "endpoints": [upstream_url],
            "target_waiting": 1_000_000,
            "fallback_max_in_flight": 1_000_000,
        }],
        "envoy": {
            "listen": f"127.0.0.1:{free_port()}",
            "admin": f"127.0.0.1:{free_port()}",
            "api_keys": {api_key(TENANT): TENANT},
        },
    }


@dataclass(frozen=True)
class PathResult:
    path: str
    fixed: HeyRun
    max: HeyRun
    # CPU microseconds per completed request, per process, in the fixed and max runs.
    cpu_us_fixed: dict[str, float]
    cpu_us_max: dict[str, float]


async def _measure(url: str, pids: dict[str, int], seconds: float) -> tuple[HeyRun, HeyRun, dict[str, float], dict[str, float]]:
    await run_hey(url, seconds=min(1.0, seconds), workers=8, rate_per_worker=50)  # warm-up: connections, caches

    async def timed(**kw: Any) -> tuple[HeyRun, dict[str, float]]:
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        run = await run_hey(url, seconds=seconds, **kw)
        return run, {name: (cpu_seconds(pid) - before[name]) * 1e6 / max(1, run.ok) for name, pid in pids.items()}

    fixed, cpu_fixed = await timed(workers=FIXED_WORKERS, rate_per_worker=FIXED_RATE / FIXED_WORKERS)
    fastest, cpu_max = await timed(workers=MAX_WORKERS)
    return fixed, fastest, cpu_fixed, cpu_max


async def run_overhead(workdir: Path, *, seconds: float = 10.0, on_step: Any = lambda label: None) -> list[PathResult]:
    """Measure the three paths in turn (see module docstring)."""
    find_hey()
    workdir.mkdir(parents=True, exist_ok=True)
    up_port = free_port()
    upstream: EnvoyProcess = await start_envoy(upstream_bootstrap(up_port, free_port()), workdir / "upstream")
    results: list[PathResult] = []
    try:
        upstream_url = f"http://127.0.0.1:{up_port}"
        config_path = workdir / "config.yaml"
        config_path.write_text(yaml.safe_dump(overhead_config(upstream_url)), encoding="utf-8")
        on_step("upstream")
        measured = await _measure(upstream_url, {}, seconds)
        results.append(PathResult("upstream", *measured))
        for path, gateway in (("envoy", "envoy"), ("envoy+extproc", "extproc")):
            on_step(path)
            (workdir / gateway).mkdir(exist_ok=True)
            stack: Stack = await start_stack(config_path, workdir / gateway, gateway=gateway, engines=False)
            async with stack:
                assert stack.envoy is not None
                pids = {"envoy": stack.envoy.process.pid}
                if stack.processor is not None:
                    pids["extproc"] = stack.processor.process.pid
                measured = await _measure(stack.envoy_url, pids, seconds)
            results.append(PathResult(path, *measured))
    finally:
        await upstream.stop()
    return results


def latency_ms(run: HeyRun) -> dict[str, float | None]:
    values = run.latencies_s
    return {q: (percentile(values, n) * 1000 if values else None) for q, n in (("p50", 50), ("p99", 99))}


def summarize_overhead(paths: list[PathResult]) -> dict[str, Any]:
    """Per path: rates, latency percentiles and CPU per request; then the differences that matter."""
    by_path = {
        p.path: {
            "fixed": {"rate": p.fixed.rate, "sent": p.fixed.sent, "ok": p.fixed.ok, **latency_ms(p.fixed)},
            "max": {"rate": p.max.rate, "sent": p.max.sent, "ok": p.max.ok, **latency_ms(p.max)},
            "cpu_us_per_request_fixed": p.cpu_us_fixed,
            "cpu_us_per_request_max": p.cpu_us_max,
        }
        for p in paths
    }
    summary: dict[str, Any] = {"fixed_rate": FIXED_RATE, "max_workers": MAX_WORKERS, "paths": by_path}
    if "envoy" in by_path and "envoy+extproc" in by_path:
        alone, hop = by_path["envoy"]["fixed"], by_path["envoy+extproc"]["fixed"]
        summary["extproc_added_ms"] = {q: hop[q] - alone[q] for q in ("p50", "p99") if hop[q] is not None and alone[q] is not None}
        summary["extproc_max_rate"] = by_path["envoy+extproc"]["max"]["rate"]
        summary["extproc_cpu_us_per_request"] = by_path["envoy+extproc"]["cpu_us_per_request_fixed"].get("extproc")
    return summary
