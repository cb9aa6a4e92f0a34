"""A priority class as the core sees it for one model: its limits and how it may use the engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BandRules:
    """One priority band of one model (the config's class settings, with the model's defaults applied)."""

    name: str
    # A request still queued after this long is refused (queue_timeout).
    max_queue_wait_s: float
    # Requests of this band the model may hold; None: only the model's cap.
    max_queued: int | None = None
    # Released only while no higher band waits and the engine is idle.
    idle_only: bool = False
    # "Idle": the engine's waiting queue is empty and it runs fewer than this
    # share of its capacity.
    idle_running_share: float = 1.0
