"""The production trace replay: the trace's rows read, classes and tenants, the compression, clipping, the window's cut."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from aiohttp import web

from extproc.tools.bench.arms import DIRECT, Arm
from extproc.tools.bench.load import Planned
from extproc.tools.bench.metrics import (
    gateway_held,
    idle_while_held,
    missed_objective,
    summarize,
    trace_class,
    ttft_in_window,
)
from extproc.tools.bench.report import scenario_markdown
from extproc.tools.bench.runner import ArmRun, Decision, EngineSample, PhaseRun, Result, replay
from extproc.tools.bench.scenarios import BATCH_ONLY_TENANT, TRACE, TRACE_ALONE, UNLOADED, Engine, Scenario
from extproc.tools.bench.trace import (
    DEFAULT_SECONDS,
    DRAIN_S,
    FLOOD,
    FLOOD_AT,
    FLOOD_TENANT,
    KINDS,
    PROFILES,
    TICKS_PER_S,
    Row,
    Source,
    TraceError,
    assign_tenants,
    clip,
    engine_seconds,
    format_ticks,
    parse_rows,
    parse_timestamp,
    read_rows,
    replay_rows,
    sources,
    time_factor,
    trace_replay,
)
from tests.httputil import serving

pytestmark = pytest.mark.unit

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


# --- reading the trace ----------------------------------------------------------------------------------------


def test_timestamps_keep_all_seven_fractional_digits() -> None:
    base = parse_timestamp("2023-11-16 18:45:10.1342190")
    # The 7th digit is 100 ns: datetime would drop it.
    assert parse_timestamp("2023-11-16 18:45:10.1342191") - base == 1
    assert parse_timestamp("2023-11-16 18:45:11.1342190") - base == TICKS_PER_S
    assert base % TICKS_PER_S == 1_342_190
    # Fewer digits are tenths, hundredths...; none is a whole second.
    assert parse_timestamp("2023-11-16 18:45:10.5") % TICKS_PER_S == 5_000_000
    assert parse_timestamp("2023-11-16 18:45:10") % TICKS_PER_S == 0
    assert format_ticks(base) == "2023-11-16 18:45:10.1342190"
    for bad in ("2023-11-16 18:45:10.12345678", "2023-11-16 18:45:10.12a", "18:45:10.1"):
        with pytest.raises(ValueError):
            parse_timestamp(bad)


def test_rows_need_the_header_and_a_bad_row_is_named_by_its_line() -> None:
    rows = parse_rows([HEADER, "2023-11-16 18:45:10.1342190,2893,33", "", "2023-11-16 18:45:10.2000000,10,5"], "t.csv")
    assert rows == [Row(parse_timestamp("2023-11-16 18:45:10.1342190"), 2893, 33, 2),
                    Row(parse_timestamp("2023-11-16 18:45:10.2"), 10, 5, 4)]
    with pytest.raises(TraceError, match=r"t\.csv:1: expected the header"):
        parse_rows(["2023-11-16 18:45:10.1342190,2893,33"], "t.csv")
    with pytest.raises(TraceError, match=r"t\.csv: empty"):
        parse_rows([], "t.csv")
    with pytest.raises(TraceError, match=r"t\.csv:3: .*not 3"):
        parse_rows([HEADER, "2023-11-16 18:45:10.1,1,1", "2023-11-16 18:45:10.2,1"], "t.csv")
    with pytest.raises(TraceError, match=r"t\.csv:2: "):
        parse_rows([HEADER, "2023-11-16 18:45:10.1,many,1"], "t.csv")


def test_the_bundled_slices_are_the_rows_their_readme_names() -> None:
    bundled = {source.kind: read_rows(source) for source in sources(["azure2023"])}
    assert set(bundled) == {"conv", "code"} and [kind for kind, _ in PROFILES["azure2023"]] == ["conv", "code"]
    conv, code = bundled["conv"], bundled["code"]
    assert (len(conv), len(code)) == (967, 443)
    assert (format_ticks(conv[0].at), conv[0].prompt_tokens, conv[0].output_tokens) == (
        "2023-11-16 18:46:00.0456300", 1070, 406)
    assert (format_ticks(code[-1].at), code[-1].prompt_tokens, code[-1].output_tokens) == (
        "2023-11-16 18:47:22.5605800", 1199, 8)
    assert all(a.at <= b.at for rows in (conv, code) for a, b in zip(rows, rows[1:], strict=False))


def test_trace_files_are_named_by_kind_or_by_profile(tmp_path: Path) -> None:
    assert [(s.kind, s.label) for s in sources(["conv=/x/a.csv", "/y/trace_code_1.csv"])] == [
        ("conv", "/x/a.csv"), ("code", "/y/trace_code_1.csv")]
    with pytest.raises(TraceError, match="conv=FILE or code=FILE"):
        sources(["/y/trace.csv"])
    with pytest.raises(TraceError, match="no such file|No such file"):
        read_rows(Source("conv", tmp_path / "missing_conv.csv", "missing_conv.csv"))


# --- classes, tenants, compression, clipping ------------------------------------------------------------------


def test_tenants_are_assigned_per_kind_seeded_and_spread_over_all() -> None:
    chats = assign_tenants(2000, KINDS["conv"], seed=5)
    assert chats == assign_tenants(2000, KINDS["conv"], seed=5)
    assert chats != assign_tenants(2000, KINDS["conv"], seed=6)
    assert set(chats) == set(KINDS["conv"].names) and len(KINDS["conv"].names) == 20
    assert KINDS["conv"].names[0] == "chat01" and KINDS["code"].names == ["code1", "code2", "code3", "code4", "code5"]
    # Uniform: each of the 20 near 100 of 2,000.
    assert all(60 < chats.count(t) < 140 for t in set(chats))
    assert set(assign_tenants(100, KINDS["code"], seed=5)) <= set(KINDS["code"].names)
    assert (KINDS["conv"].priority, KINDS["code"].priority) == ("interactive", "standard")


def test_clipping_keeps_prompt_and_answer_within_the_context() -> None:
    assert clip(1000, 100, 2048) == (1000, 100)  # fits: unchanged
    assert clip(7000, 100, 2048) == (1948, 100)  # the prompt is cut first
    assert clip(10, 5000, 2048) == (1, 2047)  # an answer beyond the context leaves one prompt token
    assert clip(0, 0, 2048) == (1, 1)
    assert all(sum(clip(p, o, 512)) <= 512 for p in (1, 300, 9000) for o in (1, 300, 9000))


# A small engine whose numbers are easy: a full batch of 4 steps in 10 + 4 x 2.5 = 20 ms, 5 ms a token;
# 0.5 ms of prefill a prompt token; 300 tokens of context.
SMALL = Engine(max_num_seqs=4, kv_cache_tokens=300, step_ms=10.0, step_ms_per_seq=2.5, prefill_ms_per_token=0.5)


def _source(kind: str, rows: list[tuple[float, int, int]]) -> tuple[Source, list[Row]]:
    t0 = parse_timestamp("2023-11-16 18:00:00")
    return (Source(kind, Path(f"{kind}.csv"), f"{kind}.csv"),
            [Row(t0 + round(at * TICKS_PER_S), p, o, i + 2) for i, (at, p, o) in enumerate(rows)])


def test_the_trace_is_compressed_to_the_target_utilisation_on_a_known_case() -> None:
    # A request of 100 prompt and 40 answer tokens: 50 ms of prefill + 40 x 5 ms = 0.25 engine-s.
    assert engine_seconds(100, 40, SMALL) == pytest.approx(0.25)
    assert time_factor(1.0, 2.0, 0.5) == pytest.approx(1.0)
    t0 = parse_timestamp("2023-11-16 18:00:00")
    conv = _source("conv", [(0.5, 100, 40), (1.0, 100, 40), (2.5, 100, 40)])  # the last is after the window
    code = _source("code", [(0.0, 100, 40), (1.9, 400, 40)])  # 400 + 40 > 300: its prompt is cut to 260
    got = replay_rows([conv, code], start=t0, seconds=2.0, engine=SMALL, utilisation=0.5, seed=1)
    # In the window: 3 requests of 0.25 engine-s and one of 130 ms + 200 ms = 0.33: 1.08 engine-s over 2 s of
    # trace at 0.5 of the engine: time x 1.08.
    work = 3 * 0.25 + 0.33
    assert got.factors["engine_s"] == pytest.approx(work)
    assert got.factors["time_factor"] == pytest.approx(work / (0.5 * 2.0))
    assert got.factors["span_s"] == pytest.approx(2.0 * work)
    assert got.factors["offered_utilisation"] == pytest.approx(0.5)
    assert got.factors["clipped_rows"] == 1 and got.factors["max_context_tokens"] == 300
    assert got.factors["kinds"]["conv"]["offered_utilisation"] == pytest.approx(0.5 / (2.0 * work))
    factor = got.factors["time_factor"]
    assert [(r.at, r.priority, r.prompt_tokens) for r in got.requests] == [
        (0.0, "standard", 100), (pytest.approx(0.5 * factor), "interactive", 100),
        (pytest.approx(1.0 * factor), "interactive", 100), (pytest.approx(1.9 * factor), "standard", 260)]
    assert {r.tenant for r in got.requests if r.priority == "standard"} <= set(KINDS["code"].names)
    with pytest.raises(TraceError, match="no row between"):
        replay_rows([conv, code], start=t0 + 10 * TICKS_PER_S, seconds=2.0, engine=SMALL, utilisation=0.5)


def test_the_default_replay_is_the_bundled_window_with_its_flood_phases_and_window() -> None:
    scenario = trace_replay(sources(["azure2023"]), engine=Engine())
    factors = scenario.replay
    assert factors["window"] == {"start": "2023-11-16 18:46:25.0000000", "seconds": DEFAULT_SECONDS}
    assert factors["offered_utilisation"] == pytest.approx(0.87) and factors["utilisation"] == 0.87
    assert [f["rows"] for f in factors["files"]] == [156, 131] and factors["clipped_rows"] == 0
    requests = scenario.requests()
    flood = [r for r in requests if r.tenant == FLOOD_TENANT]
    assert len(flood) == FLOOD and {r.at for r in flood} == {FLOOD_AT}
    assert all(r.priority == "batch" and not r.stream for r in flood)
    assert {r.priority for r in requests if r.tenant.startswith("chat")} == {"interactive"}
    assert {r.priority for r in requests if r.tenant.startswith("code")} == {"standard"}
    assert len(requests) == 156 + 131 + FLOOD
    assert scenario.window == pytest.approx(factors["span_s"] + DRAIN_S) and factors["window_s"] == scenario.window
    assert max(r.at for r in requests) < factors["span_s"]
    assert scenario.gateway == {"tenants": {FLOOD_TENANT: BATCH_ONLY_TENANT}} and TRACE in scenario.measures
    unloaded, alone = scenario.phases
    assert (unloaded.name, unloaded.arms, alone.name, alone.arms) == (UNLOADED, ("direct-fifo",),
                                                                      TRACE_ALONE, ("direct-fifo",))
    assert {r.priority for r in scenario.phase_requests(unloaded)} == {"interactive"}
    assert len(scenario.phase_requests(alone)) == 156 + 131
    assert set(scenario.tenants) == {FLOOD_TENANT, *KINDS["conv"].names, *KINDS["code"].names}
    assert scenario.time_scale == 1.0  # in real time: the gateway's own reaction weighs what it would on a GPU
    quick = trace_replay(sources(["azure2023"]), engine=Engine(), quick=True)
    assert quick.window is not None and quick.window < 30 and len(quick.requests()) < 60
    assert quick.time_scale is None  # the run's (0.25): a smoke run


def test_a_bad_window_or_load_is_refused_with_the_option_to_change() -> None:
    with pytest.raises(TraceError, match="--trace-start"):
        trace_replay(sources(["azure2023"]), engine=Engine(), start="yesterday")
    with pytest.raises(TraceError, match="no row between"):
        trace_replay(sources(["azure2023"]), engine=Engine(), start="2023-11-16 19:00:00")
    with pytest.raises(TraceError, match="--utilisation"):
        trace_replay(sources(["azure2023"]), engine=Engine(), utilisation=0)
    # Seconds after the first row: 25 s after 18:46:00.03 is the default window give or take 34 ms.
    offset = trace_replay(sources(["azure2023"]), engine=Engine(), start="25")
    assert offset.replay["window"]["start"] == "2023-11-16 18:46:25.0342750"


# --- the window's cut -----------------------------------------------------------------------------------------


def _result(priority: str, sent: float, ttft: float | None, e2e: float, tokens: int, *, cut: bool = False,
            status: int = 200) -> Result:
    return Result("t", priority, sent, sent, status, ttft, e2e, None, 10, tokens, tokens, cut=cut)


def test_requests_cut_by_the_window_are_counted_per_class_and_their_tokens_to_the_cut() -> None:
    window = 100.0
    mine = [
        _result("standard", 0, 1.0, 11.0, 10),  # answered: 10 tokens from 1 to 11
        _result("standard", 50, 2.0, 50.0, 4, cut=True),  # streaming at the cut: 4 tokens by 100
        _result("standard", 60, None, 40.0, 0, cut=True),  # no first token by the cut
        _result("standard", 70, None, 0.5, 0, status=503),  # refused
    ]
    direct = [_result("standard", 0, 1.0, 11.0, 10), _result("standard", 50, 2.0, 12.0, 8)]
    got = trace_class(mine, direct, window, 60.0, {"objective_standard_missed": 2.0}, "standard")
    assert (got["requests"], got["answered"], got["not_answered"]) == (4, 1, 3)
    assert (got["cut_waiting"], got["cut_streaming"], got["failed"]) == (1, 1, 1)
    assert got["tokens"] == pytest.approx(14) and got["tokens_vs_direct"] == pytest.approx(14 / 18)
    # Missed: no first token within 60 s (the cut one and the refused one).
    assert got["missed"] == 2 and got["processor_missed"] == 2.0 and got["processor_met"] is None
    # p50 is the 2nd of 4 (2.0 s); p99 the 4th: among those without a first token, past the window.
    assert got["ttft"] == {"p50": 2.0, "p99": None, "beyond": ["p99"]}
    assert ttft_in_window([]) == {"p50": None, "p99": None, "beyond": []}
    assert ttft_in_window(mine[:2]) == {"p50": 1.0, "p99": 2.0, "beyond": []}
    assert missed_objective(mine, None) is None and missed_objective(mine, 1.5) == 3


def test_idle_slot_seconds_while_held_from_the_decision_log_else_the_headers() -> None:
    # 4 slots; the engine runs 2 from 0 to 10 s, then 4 until 20 s.
    samples = (EngineSample(0.0, 0, 2), EngineSample(10.0, 0, 4), EngineSample(20.0, 0, 4))
    # The processor held a request from 2 to 6 s and another from 5 to 12 s (released at 6 after 4 s, at 12 after 7).
    logged = (Decision(6.0, "a", "batch", "released", 4.0), Decision(12.0, "b", "batch", "released", 7.0),
              Decision(13.0, "a", "batch", "preempted"))
    run = ArmRun("s", "extproc-rr", 1.0, (_result("batch", 2, 5.0, 18.0, 1),), samples, 20.0, {}, {"released": 2.0},
                 slots=4, decisions=logged)
    assert gateway_held(run) == [(2.0, 12.0)]
    # Held 2-12 s; below 4 slots (2 empty) from 2 to 10: 16 slot-s, of 4 x 20 (the run: to its last answer, at 20).
    assert idle_while_held(run) == {"held_s": 10.0, "below_slots_s": 8.0, "slot_s": 16.0, "over_s": 20.0,
                                    "share": pytest.approx(16 / 80)}
    # Without a log: the client's send to its release (its queue-wait header): 2 to 3 s, 2 slot-s.
    headers = ArmRun("s", "extproc-rr", 1.0, (Result("a", "batch", 2, 2, 200, 5.0, 9.0, 1.0, 10, 1, 1),), samples,
                     20.0, {}, {"released": 1.0}, slots=4)
    assert idle_while_held(headers, window=30.0)["slot_s"] == pytest.approx(2.0)
    assert idle_while_held(headers, window=30.0)["share"] == pytest.approx(2.0 / 120)


def test_the_trace_summary_and_report_name_each_class_and_the_idle_slots() -> None:
    scenario = Scenario("trace", "a trace", (), "interactive", focus_priority="interactive",
                        planned=(Planned(0, "chat01", "interactive", 10, 10),), window=20.0,
                        measures=frozenset({TRACE}),
                        replay=trace_replay(sources(["azure2023"]), engine=Engine(), quick=True).replay)
    quiet = PhaseRun((_result("interactive", 0, 0.5, 2.0, 10),), (EngineSample(0, 0, 1), EngineSample(5, 0, 0)), 5.0)
    direct = ArmRun("trace", DIRECT.name, 1.0, (_result("interactive", 0, 4.0, 20.0, 3, cut=True),),
                    (EngineSample(0, 0, 1), EngineSample(20, 0, 1)), 20.0, {}, slots=4, phases={UNLOADED: quiet},
                    objectives={"interactive": 5.0})
    gated = ArmRun("trace", "extproc-rr", 1.0, (_result("interactive", 0, 1.0, 3.0, 10),),
                   (EngineSample(0, 0, 1), EngineSample(20, 0, 1)), 20.0, {}, {"objective_interactive_met": 1.0},
                   slots=4, objectives={"interactive": 5.0},
                   decisions=(Decision(0.5, "chat01", "interactive", "released", 0.5),))
    summary = {run.arm: summarize(scenario, run, direct, 3.0) for run in (direct, gated)}
    assert summary["direct-fifo"]["idle_while_held"] is None
    assert summary["extproc-rr"]["idle_while_held"]["slot_s"] == pytest.approx(1.5)
    trace = summary["extproc-rr"]["trace"]
    assert trace["focus_reference"] == {"quiet_p50": 0.5, "quiet_p99": 0.5, "p99": 1.0, "p99_vs_quiet": 2.0}
    assert trace["classes"]["interactive"]["tokens_vs_direct"] == pytest.approx(10 / 3)
    assert "offered" in summary["direct-fifo"]["trace"] and "offered" not in trace
    arms = [DIRECT, Arm("extproc-rr", "extproc", "gateway")]
    text = "\n".join(scenario_markdown(scenario, arms, summary))
    assert "idle slot-s while held (% of the window)" in text and "1.50 (1.9%)" in text
    assert "Replayed: Azure LLM inference trace 2023" in text and "missed objective (client / processor)" in text
    assert "| interactive | direct-fifo | 1 | 0 | 1 (0 / 1 / 0) | 4.00 / 4.00 |" in text
    assert "2.0 (1.00 vs 0.50 s)" in text


class _Engine:
    """A chat endpoint that answers ``fast`` at once, streams one token of ``slow`` and holds ``held`` unanswered.

    The other two wait for ``release`` (the test's end).
    """

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        content = (await request.json())["messages"][0]["content"]
        kind = next(k for k in ("fast", "slow", "held") if k in content)
        if kind == "held":
            await self.release.wait()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
        if kind == "slow":
            await self.release.wait()
        await response.write(b"data: [DONE]\n\n")
        return response


async def test_the_runner_cuts_what_the_window_leaves_unanswered() -> None:
    app, engine = web.Application(), _Engine()
    app.router.add_post("/v1/chat/completions", engine.handle)
    async with serving(app) as url:
        try:
            prompts = {"fast": 0.0, "slow": 0.0, "held": 0.0, "late": 5.0}
            plan = [Planned(at, kind, "interactive", 40, 4) for kind, at in prompts.items()]
            done: list[int] = []
            # The held request is answered only once the replay has returned (``finally``): that it returns at all
            # says it was cut at the window, not waited for.
            results = await replay(
                [url], plan, time_scale=1.0, api_keys={}, t0=time.monotonic(), on_done=lambda: done.append(1),
                engine=Engine(chars_per_token=1, request_extras={}), unique_prompts=True, window=0.5,
            )
        finally:
            engine.release.set()
    by = {r.tenant: r for r in results}
    assert set(by) == {"fast", "slow", "held"} and len(done) == 4  # "late" is after the window: not sent
    assert by["fast"].ok and not by["fast"].cut and by["fast"].tokens == 1
    assert by["slow"].cut and not by["slow"].ok and by["slow"].tokens == 1 and by["slow"].ttft is not None
    assert by["held"].cut and by["held"].ttft is None and by["held"].tokens == 0 and by["held"].status == 0
    # Cut at the window, not before it (a lower bound: a busy machine only makes it later).
    assert by["slow"].e2e >= 0.5 - 0.01 and by["held"].error == "not answered in the window"
