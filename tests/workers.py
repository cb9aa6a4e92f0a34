"""How the suite shares pytest-xdist's workers (``-n``): which tests go to one worker, which run alone.

*Scopes* (``--dist loadscope``, scheduled by :class:`Scopes`): a module's tests
go to one worker, so its module fixtures start once (the tests of
``SPREAD_MODULES``, which share none, each go where a worker is free), and
scopes with a slow test go out first; the modules with tests
on the real vLLM servers (the session fixture ``vllm_fleet``, tests/conftest.py),
``VLLM_MODULES``, go to one worker together, so those start once in the run,
all at once, not once per worker. Collection fails if a test elsewhere uses them.

*Turns*: some tests measure time or throughput against the machine's cores
(the real vLLM, the benchmarks, the fairness comparisons), and a test beside
them on the other core would be part of what they measure. Each test takes a
turn around its setup, call and teardown (so a module's or the session's
fixtures that start with it are inside it too): shared for most tests,
exclusive for those marked ``alone``. The turns are two ``flock`` locks on
files every worker of the run opens: a gate, taken briefly by everyone in
arrival order, so that an ``alone`` test waiting for the shared holders to
finish is not overtaken by new ones, and the turn itself.

Without xdist there is one process: nothing to schedule, nothing to take
turns with. Loaded with ``-p tests.workers`` (``addopts`` in pyproject.toml),
as tests/tiers.py is.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path

import pytest
import xdist.plugin
from xdist.scheduler import LoadScopeScheduling

ALONE = "alone"
VLLM_MODULES = frozenset({
    "tests/stack/test_real_vllm.py",
    "tests/stack/test_real_vllm_valves.py",
    "tests/tools/sim/test_sim_prefix.py",
    "tests/stack/test_batches_vllm.py",
})
# Modules of long tests that share no fixture: each test is a scope of its own, so they spread over the workers.
SPREAD_MODULES = frozenset({
    "tests/tools/bench/test_bench_smoke.py",
    "tests/stack/test_budgets_downgrade.py",
    # The unit tier's longest modules (real-time simulators, batch services on sockets): one worker each was its long pole.
    "tests/tools/sim/test_sim.py",
    "tests/adapters/batches/test_batches_api.py",
    "tests/adapters/grpc/test_h2grpc_abuse.py",
})
# Workers per core with ``-n auto``: most tests spend their time waiting on processes, sockets and
# timers they started (Envoy, the simulator, Redis, Docker), so one worker per core leaves the cores
# half idle. Measured on 2 cores, the tests not marked ``alone``: 438 s with 2 workers, 234 s with 4
# (2026-12-05); 372 s with 4, 276 s with 6 (2026-12-07, more tests since).
WORKERS_PER_CORE = 3
# ``-m unit`` alone (the quick loop): its tests are in-process and mostly busy, and each worker costs
# about 2.6 s of CPU to start (importing and collecting every test module), so six workers on 2 cores
# spent more on starting than the waits they overlapped saved.
UNIT_WORKERS_PER_CORE = 2


@contextmanager
def turn(directory: Path, exclusive: bool) -> Generator[None]:
    """One test's turn: shared with the other workers' tests, or ``exclusive``, waiting until it is given."""
    with (directory / "gate").open("a") as gate, (directory / "turn").open("a") as held:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(held, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _turns_directory(config: pytest.Config) -> Path | None:
    """Where this run's workers meet, or None outside xdist.

    xdist gives each worker a temporary folder inside the run's own (``--basetemp``), which
    pytest removes with the runs before the last few: the turns live there, beside them.
    """
    basetemp = config.getoption("basetemp")
    if "PYTEST_XDIST_WORKER" not in os.environ or not basetemp:
        return None
    return Path(basetemp).parent


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    directory = _turns_directory(item.config)
    if directory is None:
        return (yield)
    with turn(directory, exclusive=item.get_closest_marker(ALONE) is not None):
        return (yield)


def scope(nodeid: str) -> str:
    """The tests that go to one worker together: a module's, the ``VLLM_MODULES``', or one test of ``SPREAD_MODULES``."""
    module = nodeid.partition("::")[0]
    if module in VLLM_MODULES:
        return "vllm"
    return nodeid if module in SPREAD_MODULES else module


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: the order is that of what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # CI installs vLLM while the tests not marked alone run (.ci/run): a vLLM test must wait for the second run.
    crowded = [item.nodeid for item in items if item.get_closest_marker("vllm") and not item.get_closest_marker(ALONE)]
    if crowded:
        raise pytest.UsageError("a test on the real vLLM must be marked alone too:\n  " + "\n  ".join(crowded))
    elsewhere = [item.nodeid for item in items if "vllm_fleet" in getattr(item, "fixturenames", ())
                 and item.nodeid.partition("::")[0] not in VLLM_MODULES]
    if elsewhere:
        raise pytest.UsageError("a test on the vllm_fleet fixture outside tests/workers.py's VLLM_MODULES:\n  "
                                + "\n  ".join(elsewhere))
    # Scopes with a slow test first, then the larger first: a long scope started last would leave
    # the other workers idle at the end. Every worker computes the same order, which Scopes keeps.
    scopes: dict[str, list[pytest.Item]] = {}
    for item in items:
        scopes.setdefault(scope(item.nodeid), []).append(item)
    ordered = sorted(scopes.values(), key=lambda tests: (not any(t.get_closest_marker("slow") for t in tests), -len(tests)))
    items[:] = [item for tests in ordered for item in tests]


class Scopes(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no type information
    """xdist's loadscope over :func:`scope`, handing scopes out in the order of the workers' collection."""

    def _split_scope(self, nodeid: str) -> str:
        return scope(nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: ``WORKERS_PER_CORE`` per core as xdist counts them, ``UNIT_WORKERS_PER_CORE`` for ``-m unit``.

    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` still wins.
    """
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    per_core = UNIT_WORKERS_PER_CORE if config.getoption("markexpr") == "unit" else WORKERS_PER_CORE
    return per_core * int(xdist.plugin.pytest_xdist_auto_num_workers(config))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> Scopes | None:
    if config.getvalue("dist") != "loadscope":
        return None
    config.option.loadscopereorder = False  # xdist's own order (the most tests first) would undo ours
    return Scopes(config, log)
