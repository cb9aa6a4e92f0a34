"""Config for the policies: bands, tenants, per-model policy settings and JWT identity."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from extproc.adapters.config import BandSettings, ConfigError, TenantSettings, parse_config
from extproc.core.bands import Band
from extproc.core.entitlement import Tenant

pytestmark = pytest.mark.unit

MODEL = {"name": "m", "endpoints": ["http://127.0.0.1:1"]}
JWKS = {"keys": [{"kty": "RSA", "kid": "k", "n": "AQAB", "e": "AQAB"}]}


def config(**top: Any) -> Any:
    return parse_config({"models": [MODEL], **top})


def test_defaults_keep_the_old_behaviour_and_make_the_lowest_band_idle_only() -> None:
    c = config()
    assert [b.idle_only for b in c.bands] == [False, False, True]
    assert [b.preemptible for b in c.bands] == [False, True, True]  # what has not begun below the first
    assert [b.engine_priority for b in c.bands] == [0, 1, 2]
    assert c.models[0].policy == "round_robin" and c.models[0].engine_priority == "auto"
    # Of the engine's queue room, lower bands keep one place while a band above has work.
    assert c.models[0].reserved_waiting is None and c.models[0].waiting_kept() == c.models[0].target_waiting - 1
    assert c.tenant("anyone").bands == c.band_names  # every band
    assert c.tenant("anyone").default_band == "standard"
    assert c.bands[2].queue_wait_s(c.models[0].max_queue_wait_s) == c.models[0].max_queue_wait_s
    assert not parse_config({"models": [MODEL], "priorities": ["only"], "default_priority": "only"}).bands[0].idle_only


def test_band_settings_and_the_longest_wait() -> None:
    c = config(bands={"batch": {"max_queue_wait_s": 900, "idle_only": False, "idle_running_share": 0.5,
                                "reserve_share": 0.1},
                      "interactive": {"max_queued": 10, "engine_priority": -1}})
    assert c.bands[2].idle_running_share == 0.5 and not c.bands[2].idle_only and c.bands[2].reserve_share == 0.1
    assert c.bands[0].max_queued == 10 and c.bands[0].engine_priority == -1
    assert c.longest_queue_wait_s(c.models[0]) == 900


def test_tenants_inherit_the_default_entry_field_by_field() -> None:
    c = config(tenants={"default": {"weight": 2, "priorities": ["batch", "standard"], "max_queued": 5},
                        "vip": {"priorities": ["interactive", "standard"], "default_priority": "interactive"}})
    assert c.tenant("nobody").bands == ("standard", "batch")  # highest first, whatever the order written
    vip = c.tenant("vip")
    assert (vip.weight, vip.max_queued, vip.bands) == (2, 5, ("interactive", "standard"))


def test_every_band_and_tenant_setting_is_a_field_of_the_core_type() -> None:
    """The file's entries resolve into the core's types by field name (the entitlement's two keys are named for the file)."""
    assert set(BandSettings.__struct_fields__) <= {f.name for f in fields(Band)}
    tenant = set(TenantSettings.__struct_fields__) - {"priorities", "default_priority"}
    assert tenant <= {f.name for f in fields(Tenant)}


@pytest.mark.parametrize(
    ("top", "message"),
    [
        ({"models": [{**MODEL, "policy": "wfq"}]}, "models[0].policy: must be one of round_robin, vtc"),
        ({"models": [{**MODEL, "cost": {"output_weight": -1}}]}, "models[0].cost.output_weight: must be a number >= 0"),
        ({"models": [{**MODEL, "engine_priority": "yes"}]}, "models[0].engine_priority: must be true, false or auto"),
        ({"bands": {"urgent": {}}}, "bands.urgent: unknown key"),
        ({"bands": {"batch": {"idle_running_share": 1.5}}}, "bands.batch.idle_running_share: must be a number in (0, 1]"),
        ({"bands": {"batch": {"reserve_share": 0.6}}}, "bands.batch.reserve_share: must be a number in [0, 0.5]"),
        ({"tenants": {"a": {"priorities": ["gold"]}}}, "tenants.a.priorities[0]: must be one of priorities"),
        ({"tenants": {"a": {"priorities": ["batch"]}}}, "tenants.a.default_priority: 'standard' is not among"),
        ({"tenants": {"a": {"weight": 0}}}, "tenants.a.weight: must be a number > 0"),
        ({"identity": {"missing_tenant": "guess"}}, "identity.missing_tenant: must be one of default, reject"),
        ({"envoy": {"jwt": {"issuer": "i"}}}, "envoy.jwt: needs exactly one of jwks"),
        ({"envoy": {"jwt": {"issuer": "i", "jwks": "{}"}}}, "envoy.jwt.jwks: must be a JWKS"),
        ({"envoy": {"jwt": {"issuer": "i", "jwks_uri": "ftp://x"}}}, "envoy.jwt.jwks_uri: must be an http(s) URL"),
        ({"envoy": {"api_keys": {"k": "t"}, "jwt": {"issuer": "i", "jwks": JWKS}}}, "envoy.jwt: use either api_keys"),
    ],
)
def test_mistakes_name_their_key_path(top: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config({"models": [MODEL], **top})
    assert message in str(error.value)


def test_jwt_accepts_an_inline_jwks_as_yaml_or_text() -> None:
    as_yaml = config(envoy={"jwt": {"issuer": "i", "jwks": JWKS, "audiences": ["a"]}}).envoy.jwt
    assert as_yaml is not None and as_yaml.tenant_claim == "sub" and as_yaml.audiences == ("a",)
    assert '"keys"' in (as_yaml.jwks or "")
