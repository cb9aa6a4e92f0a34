"""What other test modules share of test_endpoint_down.py's: Report (written for its tests)."""

from __future__ import annotations

from extproc.core.values.report import Change, EndpointEvent, Event


class Report:
    """Just what these tests read of the dispatcher's events."""

    def __init__(self) -> None:
        self.up: dict[str, bool] = {}
        self.failures = 0

    def __call__(self, event: Event) -> None:
        if isinstance(event, EndpointEvent) and event.endpoint is not None and event.change in (Change.UP, Change.DOWN):
            self.up[event.endpoint] = event.change is Change.UP
        elif isinstance(event, EndpointEvent) and event.change is Change.RELEASE_FAILED:
            self.failures += 1
