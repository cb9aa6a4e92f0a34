"""Generated Envoy configs for the tests: each variant on free ports, and the protobuf check of a bootstrap.

The protobuf check parses a generated bootstrap into Envoy's own
``Bootstrap`` message (``json_format.ParseDict``, about 2 ms): every field
name, enum value and typed extension must exist in Envoy's API. It runs in
the unit tier; ``envoy --mode validate`` (the integration tier) also checks
what only Envoy knows, such as cluster references and its own constraints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from extproc.adapters import envoy
from extproc.adapters.config import Config, load_config, parse_config
from extproc.adapters.envoy import bootstrap
from extproc.tools.procs import free_port
from tests.tlsutil import processor_tls

ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = ROOT / "extproc" / "data" / "demo.yaml"
DEMO_BOOTSTRAP = ROOT / "envoy" / "demo-bootstrap.yaml"
JWT_CONFIG = ROOT / "envoy" / "jwt-extproc.yaml"
JWT_BOOTSTRAP = ROOT / "envoy" / "jwt-bootstrap.yaml"
# One of each kind of generated bootstrap (identity, endpoint addressing, TLS, ext_proc or not).
VARIANTS = ("demo", "no-keys-hostnames", "https", "jwt-remote", "jwt-inline", "no-ext-proc", "sharded-open", "cluster",
            "processor-mtls", "batches")


def free_port_config(api_keys: dict[str, str] | None = None, **overrides: Any) -> Config:
    """A two-model config whose every listening address is a free local port.

    Nothing listens on the gRPC (processor) or model ports.
    """
    grpc, metrics, listen, admin, m1, m2 = (free_port() for _ in range(6))
    raw: dict[str, Any] = {
        "listen": {"grpc": f"127.0.0.1:{grpc}", "metrics": f"127.0.0.1:{metrics}"},
        "models": [
            {"name": "m-one", "endpoints": [f"http://127.0.0.1:{m1}"], "max_queue_wait_s": 5},
            {"name": "m/two", "endpoints": [f"http://127.0.0.1:{m2}"], "max_queue_wait_s": 7},
        ],
        "envoy": {
            "listen": f"127.0.0.1:{listen}",
            "admin": f"127.0.0.1:{admin}",
            "api_keys": {"key-alice": "alice"} if api_keys is None else api_keys,
        },
    }
    raw.update(overrides)
    return parse_config(raw)


def variant_bootstrap(variant: str, workdir: Path) -> dict[str, Any]:
    """The bootstrap generated for one of :data:`VARIANTS`; files it names (certificates) are made in ``workdir``."""
    if variant == "demo":
        return bootstrap(load_config(DEMO_CONFIG))
    if variant == "no-ext-proc":  # the benchmark's Envoy-only baseline
        return bootstrap(load_config(DEMO_CONFIG), ext_proc=False)
    if variant == "jwt-remote":
        return bootstrap(load_config(JWT_CONFIG))
    if variant == "jwt-inline":
        jwks = {"keys": [{"kty": "oct", "kid": "k", "alg": "HS256", "k": "c2VjcmV0LXNlY3JldC1zZWNyZXQ"}]}
        return bootstrap(free_port_config(api_keys={}, envoy={"jwt": {"issuer": "me", "jwks": jwks}}))
    if variant == "no-keys-hostnames":
        return bootstrap(free_port_config(
            api_keys={},
            listen={"grpc": "localhost:50051"},
            models=[{"name": "llama", "endpoints": ["http://vllm-llama.internal:8000", "http://127.0.0.1:8001"]}],
        ))
    if variant == "sharded-open":  # per-model sharding, the unscheduled routes carrying the overrides
        shards = {
            name: {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}", "models": [model]}
            for name, model in (("a", "m-one"), ("b", "m/two"))
        }
        return bootstrap(free_port_config(shards=shards, envoy={"processor_failure": "open"}))
    if variant == "cluster":  # active-active: the processor cluster lists every instance
        instances = {name: {"grpc": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"} for name in "abc"}
        return bootstrap(free_port_config(cluster={"redis_url": "redis://127.0.0.1:6379/0", "instances": instances}))
    if variant == "processor-mtls":  # mutual TLS to the processor, reached by name
        tls, envoy = processor_tls(workdir / "tls")
        return bootstrap(free_port_config(listen={"grpc": f"localhost:{free_port()}", "tls": tls}, envoy=envoy))
    if variant == "batches":  # the batch API's routes and the runner's own listener, keyed
        return bootstrap(free_port_config(batches={
            "directory": str(workdir / "batches"), "listen": f"127.0.0.1:{free_port()}",
            "runner_listen": f"127.0.0.1:{free_port()}", "runner_key": "k"}))
    assert variant == "https", variant
    return bootstrap(free_port_config(models=[{"name": "remote", "endpoints": ["https://llm.example.com:443"]}]))


bootstrap_message = envoy.bootstrap_message
