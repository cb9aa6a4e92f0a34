"""Release rules: how many held requests a model pool may release now, registered by the name ``gate:`` takes.

One module per rule, each a :class:`~extproc.core.release.rule.ReleaseRule`:

* ``adaptive`` (adaptive.py, the default): each endpoint holds up to a limit
  learned online (adaptive_limit.py);
* ``waiting_target`` (waiting_target.py): the engine's waiting queue at a target;
* ``static_concurrency`` (static_concurrency.py): a fixed in-flight cap per endpoint;
* ``static_rate`` (static_rate.py): a fixed release rate for the pool.

All of them stand on the same pieces (pool.py builds them and feeds them
every event): the load estimate (estimate.py), endpoint health (health.py,
told through health_log.py) and endpoint picking (picking.py).

To add one: copy waiting_target.py (a rule that reads the metrics; degraded
endpoints fall back to their caps through metric_rule.py) or
static_concurrency.py (one that ignores them), give the class a new ``name``,
list it below. The config accepts the name from then on
(``requires`` and ``per_endpoint`` become its cross-field checks), and
tests/core/release/test_gate.py's lag tests show whether it keeps the engine's queue short
when the metrics lag.
"""

from __future__ import annotations

from extproc.core.release.adaptive import Adaptive
from extproc.core.release.rule import ReleaseRule, RuleSettings, RuleSnapshot
from extproc.core.release.static_concurrency import StaticConcurrency
from extproc.core.release.static_rate import StaticRate
from extproc.core.release.waiting_target import WaitingTarget

__all__ = ["RULES", "ReleaseRule", "RuleSettings", "RuleSnapshot"]

RULES: dict[str, type[ReleaseRule]] = {
    rule.name: rule for rule in (Adaptive, WaitingTarget, StaticConcurrency, StaticRate)
}
