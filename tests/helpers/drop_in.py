"""What other test modules share of test_drop_in.py's: USER_ENVOY, user_envoy (written for its tests)."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from extproc.tools.procs import free_port
from tests.paths import FIXTURES

USER_ENVOY = FIXTURES / "user-envoy.yaml"


def user_envoy(api_port: int, engine: str | None = None) -> dict[str, Any]:
    """The operator's bootstrap on free ports; ``engine`` adds their own cluster for the model's engine."""
    doc: dict[str, Any] = yaml.safe_load(USER_ENVOY.read_text())
    doc["admin"]["address"]["socket_address"]["port_value"] = free_port()
    doc["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = free_port()
    api = doc["static_resources"]["clusters"][0]
    api["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["port_value"] = api_port
    if engine is not None:
        host, _, port = engine.removeprefix("http://").rpartition(":")
        mine = copy.deepcopy(api)
        mine["name"] = mine["load_assignment"]["cluster_name"] = "my_engine"
        mine["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] = {
            "address": host, "port_value": int(port)
        }
        doc["static_resources"]["clusters"].append(mine)
    return doc
