"""The production trace's priority comparison in simulated time: the gateway against the engine's own priority queue.

The bench's trace scenario (``extproc-dev bench --trace``: the bundled window of
the Azure LLM inference trace 2023, chats as ``interactive`` over 20 tenants,
code as ``standard`` over 5, 300 non-streamed batch requests at once 10 s in)
on the simulator's engine model, exactly repeatable (``tests/tracereplay.py``).
The reference is what one engine flag gives: vLLM's ``--scheduling-policy
priority``, each class's place written as the request's priority. The figures
are printed; docs/decisions.md and docs/reports/benchmarks.md give them.
"""

from __future__ import annotations

import asyncio

import pytest

from extproc.tools.bench.trace import sources
from tests.tracereplay import Figures, direct, gateway, replay

pytestmark = pytest.mark.unit

INTERACTIVE, STANDARD, BATCH = range(3)


def show(name: str, mine: Figures, reference: Figures, fifo: Figures) -> None:
    ratios = " ".join(f"{cls} p99 {m.p99 / r.p99:.2f} worst {m.worst_tenant / r.worst_tenant:.2f} "
                      f"answered {m.answered / r.answered:.2f};"
                      for cls, m, r in zip(("interactive", "standard"), mine.classes, reference.classes, strict=False))
    print(f"{name}: {ratios} batch answered {mine.classes[BATCH].answered / reference.classes[BATCH].answered:.2f}; "
          f"tokens {mine.tokens / fifo.tokens:.3f} of FIFO ({reference.tokens / fifo.tokens:.3f} the reference's); "
          f"idle while held {mine.idle_while_held:.2%}; {mine.preempted} preempted")


async def arms() -> tuple[Figures, Figures, Figures, Figures]:
    """Straight to the engine's priority queue and FIFO, through the gateway in front of an engine in arrival order
    and one with a priority queue: the defaults (reserved_waiting: target_waiting - 1 = 2)."""
    run = replay(sources(["azure2023"]))
    return (direct(run, "priority"), direct(run, "fcfs"),
            gateway(run, engine_priority=False, max_preemptions_per_s=2.0, reserved_waiting=2),
            gateway(run, engine_priority=True, max_preemptions_per_s=2.0))


@pytest.fixture(scope="module")
def trace() -> tuple[Figures, Figures, Figures, Figures]:
    return asyncio.run(arms())  # the core's futures need a loop; one replay serves both tests


def test_behind_an_engine_with_a_priority_queue_the_gateway_serves_every_class_at_least_as_well(
    trace: tuple[Figures, Figures, Figures, Figures],
) -> None:
    """Chats start sooner than the engine's own queue starts them, batch completes as much, and the engine is kept
    as busy: the gateway knows more (who is waiting where) and takes back batch work that costs little to take back."""
    reference, fifo, _, mine = trace
    show("engine priority", mine, reference, fifo)
    assert mine.classes[INTERACTIVE].p99 < reference.classes[INTERACTIVE].p99
    assert mine.classes[INTERACTIVE].worst_tenant < reference.classes[INTERACTIVE].worst_tenant
    assert mine.classes[BATCH].answered >= 0.98 * reference.classes[BATCH].answered
    assert mine.tokens >= 0.98 * reference.tokens
    assert mine.idle_while_held < 0.01


def test_in_front_of_an_engine_in_arrival_order_the_gateway_keeps_it_busy_and_the_batch_moving(
    trace: tuple[Figures, Figures, Figures, Figures],
) -> None:
    """An engine that serves its queue in arrival order, the default: the gateway keeps it nearly as busy as a queue
    of hundreds inside it would, and the batch completes about what the engine's priority queue completes."""
    reference, fifo, mine, _ = trace
    show("arrival order", mine, reference, fifo)
    assert mine.classes[BATCH].answered >= 0.95 * reference.classes[BATCH].answered
    assert mine.tokens >= 0.97 * reference.tokens
    assert mine.idle_while_held < 0.015
    assert all(c.answered == r.answered for c, r in zip(mine.classes[:BATCH], reference.classes, strict=False))
