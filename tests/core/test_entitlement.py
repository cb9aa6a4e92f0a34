"""The band a request gets, decided in the core without gRPC: asked for, limited by the tenant's entitlement."""

from __future__ import annotations

import pytest

from extproc.core.entitlement import Granted, Tenant, grant
from extproc.core.values.outcomes import Refusal, Refused

pytestmark = pytest.mark.unit

CLASSES = ("interactive", "standard", "batch")


@pytest.mark.parametrize(("allowed", "asked", "expected"), [
    (CLASSES, "interactive", Granted(0)),
    (("standard", "batch"), "interactive", Granted(1, requested=0)),  # the next lower class it may use
    (("interactive", "batch"), "standard", Granted(2, requested=1)),  # skips a class it may not use
    (("standard", "batch"), "", Granted(1)),  # asks for none: the default
    (("standard", "batch"), "urgent!!", Granted(1)),  # a class that does not exist: the default
    (("batch",), "batch", Granted(2)),
])
def test_a_request_gets_what_it_asks_within_its_entitlement_never_more(
        allowed: tuple[str, ...], asked: str, expected: Granted) -> None:
    assert grant(CLASSES, Tenant(allowed, "standard"), "t", asked) == expected


def test_a_class_below_everything_the_tenant_may_use_is_refused_not_upgraded() -> None:
    with pytest.raises(Refused) as refused:
        grant(CLASSES, Tenant(("interactive",), "interactive"), "chat", "batch")
    assert refused.value.refusal is Refusal.PRIORITY_NOT_ALLOWED and "'chat'" in refused.value.message
