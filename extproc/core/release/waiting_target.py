"""``gate: waiting_target``: keep the engine's waiting queue at ``target_waiting``, learn nothing.

The simplest rule: ``allowance = target_waiting - waiting``, where
``waiting = held - running`` from the load estimate (the engine runs what the
scrape saw running, plus the idle-band releases sent into free slots since).
It never learns capacity beyond what it has seen running: while the engine
does not queue it releases ``target_waiting`` more per scrape that shows the
last ones running. The smallest metric-reading rule: copy this one to write
a new rule.
"""

from __future__ import annotations

from extproc.core.release.metric_rule import MetricRule


class WaitingTarget(MetricRule):
    name = "waiting_target"

    def room(self, endpoint: str | None) -> float:
        endpoints = len(self.estimate.endpoints) if endpoint is None else 1
        return self.settings.target_waiting * endpoints - self.estimate.now(endpoint).waiting
