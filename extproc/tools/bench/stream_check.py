"""What reading each stream's first event costs (``check_stream_start``): CPU and latency per streamed request.

One processor and one Envoy in front of two simulators with the same
settings, one model on each: ``plain`` (streams pass as usual: no body
through the processor) and ``checked`` (the response body in duplex, the
headers held until the first event, every chunk given back). Rounds alternate
between the two, so the comparison is within one run on a shared machine.
Each round sends ``streams`` streams of ``tokens`` tokens, ``concurrency`` at
a time, and measures the processor's and Envoy's CPU (from ``/proc``) per
stream, and each stream's time to its first token and its whole time.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from extproc.tools.power_user import Outcome, chat
from extproc.tools.procs import cpu_seconds, free_port
from extproc.tools.stack import start_stack

ARMS = ("plain", "checked")
# A simulated engine that answers at once and streams fast: what is measured is the gateway, not the engine.
SIM_ARGS = ("--time-scale", "0.05", "--max-num-seqs", "64", "--visibility-delay-ms", "0")


@dataclass
class Arm:
    """One model's rounds: CPU seconds per process, and every stream's outcome."""

    cpu_s: dict[str, float] = field(default_factory=lambda: {"processor": 0.0, "envoy": 0.0})
    outcomes: list[Outcome] = field(default_factory=list)


def _config(workdir: Path) -> Path:
    """Two models, one simulator each, the gate wide open (nothing held: the hop alone is measured)."""
    models = [{"name": name, "endpoints": [f"http://127.0.0.1:{free_port()}"], "gate": "static_concurrency",
               "max_in_flight": 10_000, "check_stream_start": name == "checked"} for name in ARMS]
    doc = {
        "listen": {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"},
        "models": models,
        "envoy": {"listen": f"127.0.0.1:{free_port()}", "admin": f"127.0.0.1:{free_port()}"},
    }
    path = workdir / "stream-check.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


async def run_stream_check(workdir: Path, *, rounds: int = 6, streams: int = 200, concurrency: int = 8,
                           tokens: int = 64) -> dict[str, Any]:
    """Measure both arms, alternating; the summary (:func:`summarize`)."""
    arms = {name: Arm() for name in ARMS}
    workdir.mkdir(parents=True, exist_ok=True)
    async with await start_stack(_config(workdir), workdir, sim_args=SIM_ARGS) as stack:
        assert stack.processor is not None and stack.envoy is not None
        pids = {"processor": stack.processor.process.pid, "envoy": stack.envoy.process.pid}
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            gate = asyncio.Semaphore(concurrency)

            async def one(model: str) -> Outcome:
                async with gate:
                    return await chat(session, stack.envoy_url, "t", model, api_key=None, max_tokens=tokens)

            for name in ARMS:  # warm both paths up: connections, caches
                await asyncio.gather(*(one(name) for _ in range(concurrency)))
            for i in range(rounds):
                for name in ARMS if i % 2 == 0 else ARMS[::-1]:
                    before = {p: cpu_seconds(pid) for p, pid in pids.items()}
                    arms[name].outcomes += await asyncio.gather(*(one(name) for _ in range(streams)))
                    for p, pid in pids.items():
                        arms[name].cpu_s[p] += cpu_seconds(pid) - before[p]
    return summarize(arms, tokens)


def _p(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def summarize(arms: dict[str, Arm], tokens: int) -> dict[str, Any]:
    """Per arm: CPU µs per stream (and per chunk) of the processor and Envoy, time to first token and whole time
    (p50, p99, ms); and what the check adds over the plain arm."""
    out: dict[str, Any] = {"tokens": tokens, "arms": {}}
    for name, arm in arms.items():
        ok = [o for o in arm.outcomes if o.status == 200 and o.tokens == tokens]
        ttft = [o.ttft_s * 1000 for o in ok if o.ttft_s is not None]
        total = [o.total_s * 1000 for o in ok]
        out["arms"][name] = {
            "streams": len(arm.outcomes), "complete": len(ok),
            "cpu_us_per_stream": {p: round(s / len(arm.outcomes) * 1e6) for p, s in arm.cpu_s.items()},
            "ttft_ms": {"p50": round(_p(ttft, 50), 2), "p99": round(_p(ttft, 99), 2)},
            "total_ms": {"p50": round(_p(total, 50), 2), "p99": round(_p(total, 99), 2)},
        }
    plain, checked = out["arms"]["plain"], out["arms"]["checked"]
    added = {p: checked["cpu_us_per_stream"][p] - plain["cpu_us_per_stream"][p] for p in ("processor", "envoy")}
    # A stream of n tokens is n content chunks plus the role's, the [DONE] and the end: one message each way for each.
    chunks = tokens + 3
    out["added"] = {
        "cpu_us_per_stream": added,
        "cpu_us_per_chunk": {p: round(us / chunks, 1) for p, us in added.items()},
        "ttft_ms_p50": round(checked["ttft_ms"]["p50"] - plain["ttft_ms"]["p50"], 2),
        "total_ms_p50": round(checked["total_ms"]["p50"] - plain["total_ms"]["p50"], 2),
        "total_ms_p99": round(checked["total_ms"]["p99"] - plain["total_ms"]["p99"], 2),
    }
    return out
