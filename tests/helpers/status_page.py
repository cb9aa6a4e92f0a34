"""What other test modules share of test_status_page.py's: CONFIG, OBJECTIVE_EVENTS, Port (written for its
tests).
"""

from __future__ import annotations

from extproc.adapters.config import parse_config
from extproc.adapters.runtime import Dispatchers, build_runtimes
from extproc.adapters.telemetry import Telemetry
from extproc.adapters.web.app import MetricsServer, build_app
from extproc.core.dispatcher import ModelDispatcher
from extproc.core.values.outcomes import Refusal
from extproc.core.values.report import RequestEvent, Step
from extproc.tools.procs import free_port

CONFIG = parse_config({
    "priorities": ["interactive", "standard", "batch"],
    "default_priority": "standard",
    "models": [
        {"name": "m", "endpoints": ["http://127.0.0.1:1"], "advanced": {"fallback_max_in_flight": 1}},
        {"name": "fixed", "endpoints": ["http://127.0.0.1:2"], "gate": "static_rate", "release_rate": 2},
    ],
})


class Port:
    """The metrics-port app on a free loopback port, with dispatchers the test feeds by hand."""

    def __init__(self) -> None:
        self.telemetry = Telemetry()
        self.dispatchers = Dispatchers(build_runtimes(CONFIG, self.telemetry))
        self.draining = False
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = MetricsServer(
            build_app(self.telemetry.registry, self.dispatchers, lambda: self.draining, self.telemetry),
            "127.0.0.1", port,
        )

    async def __aenter__(self) -> Port:
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop()

    @property
    def m(self) -> ModelDispatcher:
        return self.dispatchers["m"]

    def report(self, *events: RequestEvent, model: str = "m") -> None:
        """Events as the core reports them, straight into the model's telemetry (a request is queued first)."""
        for event in events:
            if event.step is not Step.PREEMPTED:
                self.telemetry.models[model](RequestEvent(Step.QUEUED, event.band, event.tenant))
            self.telemetry.models[model](event)


# What each TTFT objective section below is fed: interactive releases on time (alice) and late (bob),
# one refused after its deadline (carol), batch requests preempted (dave).
OBJECTIVE_EVENTS = (
    RequestEvent(Step.RELEASED, "interactive", "alice", waited_s=1.0, slack_s=4.0),
    RequestEvent(Step.RELEASED, "interactive", "alice", waited_s=2.0, slack_s=3.0),
    RequestEvent(Step.RELEASED, "interactive", "bob", waited_s=5.5, slack_s=-0.5),
    RequestEvent(Step.REFUSED, "interactive", "carol", waited_s=6, refusal=Refusal.SHUTTING_DOWN, slack_s=-1.0),
    RequestEvent(Step.PREEMPTED, "batch", "dave", waited_s=0.5),
    RequestEvent(Step.PREEMPTED, "batch", "dave", waited_s=0.7),
)
