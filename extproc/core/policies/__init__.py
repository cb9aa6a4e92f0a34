"""Fairness inside one priority band: the policies, registered by the name a model's ``policy:`` takes.

One module per policy, each behind :class:`~extproc.core.policies.base.BandPolicy`:

* ``round_robin`` (round_robin.py): tenants take turns, one request each;
* ``vtc`` (vtc.py): virtual token counters, tenants share weighted cost;
* ``deadline`` (deadline.py): earliest deadline first, within one request of
  ``vtc``'s fair share (no cluster form);
* ``locality`` (locality.py): the longest expected prefix-cache hit first,
  within a deficit quantum of ``vtc``'s fair share (no cluster form).

To add one: copy round_robin.py, give its ``POLICY`` a new name, and list it
below. The config accepts the name from then on, and the shared conformance
test (tests/core/policies/test_policy_conformance.py) runs it: every request ends exactly
once, each tenant's requests leave in order (arrival, or deadline for a
``by_deadline`` policy; a policy may declare ``overtakes``), no tenant starves, and the ``U + K·E`` bound of
:class:`~extproc.core.policies.base.Policy` holds, plus its declared
``window_requests``. Its ``cluster`` form
(:class:`~extproc.core.policies.base.ClusterForm`) is what a ``cluster:`` runs
instead; the same suite checks it on a real Redis, and the config refuses a
policy without one when a cluster is configured.
"""

from __future__ import annotations

from extproc.core.policies import deadline, locality, round_robin, vtc
from extproc.core.policies.base import BandPolicy, ClusterForm, Policy, TenantWeight

__all__ = ["POLICIES", "BandPolicy", "ClusterForm", "Policy", "TenantWeight"]

POLICIES: dict[str, Policy] = {
    policy.name: policy for policy in (round_robin.POLICY, vtc.POLICY, deadline.POLICY, locality.POLICY)
}
