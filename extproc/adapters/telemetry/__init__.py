"""The processor's own Prometheus metrics, and the decision and health log lines that go with them.

* ``series.py``   the series table: every metric's name, help, labels (and buckets), built on a registry;
* ``labels.py``   tenant label values, bounded (the configured tenants, then ``other``);
* ``events.py``   what the adapters report of a model beside the core's events;
* ``model.py``    each model's recorder (:class:`ModelTelemetry`): every event of the model, into its series;
* ``deferral.py`` while the processor serves, those events written after the replies, not before;
* ``process.py``  one processor's :class:`Telemetry`: its own registry, the series, each model's recorder;
* ``objectives.py`` TTFT objectives met or missed, per class and tenant: the status page's view.

The names below are the package's surface; callers import them from here.
"""

from extproc.adapters.telemetry.events import Admitted, ClusterTrip, ServedElsewhere, Signed, TurnedAway
from extproc.adapters.telemetry.labels import UNKNOWN_MODEL, TenantLabels
from extproc.adapters.telemetry.model import ModelTelemetry
from extproc.adapters.telemetry.process import Telemetry

__all__ = [
    "UNKNOWN_MODEL",
    "Admitted",
    "ClusterTrip",
    "ModelTelemetry",
    "ServedElsewhere",
    "Signed",
    "Telemetry",
    "TenantLabels",
    "TurnedAway",
]
