"""What other test modules share of test_sim.py's: FakeTime, MODEL, _value (written for its tests)."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

MODEL = "sim-model"


class FakeTime:
    """Injected clock and sleep: simulated time advances only when the engine sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        await asyncio.sleep(0)


def _value(text: str, sample_name: str, **labels: str) -> float:
    """The value of the one sample named ``sample_name`` whose labels include ``labels``."""
    matches = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == sample_name and labels.items() <= sample.labels.items()
    ]
    assert len(matches) == 1, (sample_name, labels, matches)
    return matches[0]
