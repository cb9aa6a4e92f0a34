"""The overhead benchmark's parts: the fast upstream, the uncontended config, and a short run with `hey`."""

from __future__ import annotations

import shutil
from pathlib import Path

import aiohttp
import pytest

from extproc.adapters.config import parse_config
from extproc.adapters.protocol.dialects import parse_load
from extproc.tools.bench.arms import MODEL
from extproc.tools.bench.held import run_held
from extproc.tools.bench.overhead import REQUEST_BODY, overhead_config, run_overhead, summarize_overhead, upstream_bootstrap
from extproc.tools.bench.report import overhead_markdown
from extproc.tools.envoy_proc import start_envoy
from extproc.tools.procs import free_port

pytestmark = [pytest.mark.integration, pytest.mark.alone]


async def test_fast_upstream_answers_chat_and_reports_an_idle_engine(tmp_path: Path) -> None:
    port = free_port()
    async with await start_envoy(upstream_bootstrap(port, free_port()), tmp_path):
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/metrics") as response:
                load = parse_load("vllm", await response.text(), MODEL)
            assert (load.waiting, load.running) == (0, 0)
            headers = {"content-type": "application/json"}
            async with session.post(f"{url}/v1/chat/completions", data=REQUEST_BODY, headers=headers) as response:
                assert response.status == 200
                assert (await response.json())["choices"][0]["message"]["content"]
    config = parse_config(overhead_config(url))
    assert config.models[0].target_waiting >= 1_000_000  # the gate never holds


@pytest.mark.skipif(shutil.which("hey") is None, reason="the load tool `hey` is not installed (apt-get install hey)")
async def test_short_overhead_run_measures_every_path(tmp_path: Path) -> None:
    """Direct, Envoy alone, the hop's floor, our metadata fast path (on each transport) and the GIE shape's two body
    modes, all answered."""
    summary = summarize_overhead(await run_overhead(tmp_path, seconds=0.5))
    assert list(summary["paths"]) == ["upstream", "envoy", "envoy+null", "envoy+extproc", "envoy+extproc-grpcio", "gie-buffered",
                                      "gie-duplex"]
    assert list(summary["added_ms"]) == ["envoy+extproc", "envoy+extproc-grpcio", "gie-buffered", "gie-duplex"]
    assert all(summary["transports"][t]["cpu_us_per_request_fixed"] > 0 for t in ("builtin", "grpcio"))
    assert summary["added_ms"]["envoy+extproc"] == summary["extproc_added_ms"]
    for path, figures in summary["paths"].items():
        for run in ("fixed", "max"):
            assert figures[run]["ok"] == figures[run]["sent"] > 0, (path, run)
            assert figures[run]["p50"] > 0
    assert summary["extproc_max_rate"] > 0
    assert summary["extproc_cpu_us_per_request"] > 0 and summary["extproc_cpu_us_per_request_max"] > 0
    assert 0 < summary["extproc_rate_vs_envoy"] == summary["extproc_max_rate"] / summary["paths"]["envoy"]["max"]["rate"]
    assert set(summary["extproc_added_ms"]) == {"p50", "p99"}
    floor = summary["floor"]
    assert set(floor["added_ms"]) == {"p50", "p99"} and all(v is not None for v in floor["added_ms"].values())
    assert len(floor["added_p50_ms_by_round"]) == summary["rounds"]
    assert floor["cpu_us_per_request"] > 0 and floor["cpu_us_per_request_max"] > 0 and floor["max_rate"] > 0
    assert list(summary["paths"]["envoy+null"]["cpu_us_per_request_fixed"]) == ["envoy", "null"]
    report = "\n".join(overhead_markdown(summary))
    assert "| the hop's floor (a processor that only says CONTINUE) |" in report
    assert "| our processor (envoy+extproc) |" in report


async def test_memory_per_held_request_is_measured_on_each_transport(tmp_path: Path) -> None:
    """grpc.aio's native per-stream state shows: several times the builtin server's per held request (measured 27 vs 6 KB)."""
    held = await run_held(tmp_path, 500)
    figures = summarize_overhead([], held)["transports"]
    assert [f["held"] for f in figures.values()] == [499, 499]  # all queued but the one the gate released
    assert figures["grpcio"]["kb_per_held"] > 2 * figures["builtin"]["kb_per_held"] > 0
    table = "\n".join(overhead_markdown({"paths": {}, "max_workers": 32, "transports": figures}))
    assert "| builtin | 499 |" in table and "| grpcio | 499 |" in table
