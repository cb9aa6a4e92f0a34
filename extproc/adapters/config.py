"""The YAML configuration: typed, validated once at start-up.

Every setting is read here and nowhere else, so mistakes are refused before
the server binds a port, each with the key path of the offending value
(``models[1].target_waiting: must be an integer >= 1, got 'three'``), all of
them at once. The file's shape is the msgspec structs below, whose annotations
carry the constraints; ``validate.py`` converts a document into them and
collects the errors. Unknown keys are errors too: a misspelt
``taget_waiting`` silently falling back to its default is the kind of
surprise an operator finds only under load. Rules between fields are the
``problems()`` methods, next to the fields they relate.

:class:`ConfigFile` is the file as written; :class:`Config` is what the
program reads, with the defaults that depend on other settings filled in. A
band and a tenant resolve straight into the core's own types
(:class:`~extproc.core.bands.Band`, :class:`~extproc.core.entitlement.Tenant`),
field by field by name, so a new band or tenant setting is a field in the
file's struct and one in the core's type.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
import yaml
from msgspec import Meta

from extproc.adapters.engines.dialects import DIALECTS
from extproc.adapters.ext_proc.tls import TlsFileError, load_context
from extproc.adapters.validate import Invalid, choice, convert
from extproc.core.bands import Band
from extproc.core.cost import CostWeights
from extproc.core.entitlement import Tenant
from extproc.core.policies import POLICIES
from extproc.core.release import RULES

# The engines whose /metrics the gate reads (adapters/engines/dialects.py owns the list).
ENGINES = tuple(DIALECTS)
# The per-tenant template in `tenants:`; its fields are every other tenant's defaults.
DEFAULT_TENANT_KEY = "default"


def split_address(text: str) -> tuple[str, int]:
    """A validated ``HOST:PORT`` (IPv6 in brackets allowed) -> (host, port)."""
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def is_ip_address(host: str) -> bool:
    """True for a literal IPv4/IPv6 address, False for a host name (which needs DNS)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class ConfigError(ValueError):
    """Configuration values are missing or wrong; each line names a key path."""

    def __init__(self, *errors: str) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


# --- value types: what a leaf must be -----------------------------------------------------


def _header(value: str) -> str:
    if not value.strip() or value != value.lower() or any(c.isspace() for c in value):
        raise ValueError(value)
    return value


def _address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(value)
    return value


def _endpoint(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:  # .port: ValueError if bad
        raise ValueError(value)
    return value.rstrip("/")


def _http_url(value: str) -> str:
    """An http(s) URL whose port may be implied by its scheme."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(value)
    return value


def _redis_url(value: str) -> str:
    """Where Redis listens, as redis-py reads it: ``redis://`` or ``rediss://`` (TLS) with a host, or ``unix://`` with a path."""
    parts = urlsplit(value)
    if parts.scheme in ("redis", "rediss"):
        # .port raises ValueError for a port that is not a number in range; the path is the database number.
        if not parts.hostname or parts.port == 0 or not re.fullmatch(r"/?\d*", parts.path):
            raise ValueError(value)
    elif parts.scheme != "unix" or not parts.path:
        raise ValueError(value)
    return value


def _jwks_text(raw: Any) -> Any:
    """A JWKS written as YAML becomes the JSON text Envoy takes inline."""
    return json.dumps(raw, sort_keys=True) if isinstance(raw, dict) else raw


def _jwks(value: str) -> str:
    try:
        keys = json.loads(value).get("keys")
    except (ValueError, AttributeError):
        keys = None
    if not isinstance(keys, list) or not keys:
        raise ValueError(value)
    return value


NonEmpty = Annotated[str, Meta(pattern=r"\S", description="a non-empty string")]
Header = Annotated[str, Meta(description="a lower-case header name without spaces", extra={"check": _header})]
Address = Annotated[str, Meta(description="HOST:PORT", extra={"check": _address})]
Endpoint = Annotated[str, Meta(description="an http(s)://HOST:PORT URL", extra={"check": _endpoint})]
HttpUrl = Annotated[str, Meta(description="an http(s) URL", extra={"check": _http_url})]
RedisUrl = Annotated[str, Meta(description="a redis://HOST[:PORT][/DB], rediss://... or unix:///PATH URL",
                               extra={"check": _redis_url})]
Jwks = Annotated[str, Meta(description='a JWKS: a JSON object with a non-empty "keys" list',
                           extra={"parse": _jwks_text, "check": _jwks})]
Count = Annotated[int, Meta(ge=1)]
Count0 = Annotated[int, Meta(ge=0)]
Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
Share = Annotated[float, Meta(gt=0, le=1)]
# A share that may be nothing but never everything (a minimum share of releases).
ReleaseShare = Annotated[float, Meta(ge=0, lt=1)]
Names = Annotated[tuple[NonEmpty, ...], Meta(min_length=1)]


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A mapping in the file: typed fields, unknown keys refused.

    Subclasses inherit these options; they repeat ``frozen=True`` for the type
    checker, which reads each class on its own.
    """


# --- the file's sections -----------------------------------------------------------------


class TlsSettings(_Section, frozen=True):
    """TLS on the gRPC port (adapters/ext_proc/tls.py): the processor's certificate, and optionally the clients' CA.

    The files are loaded here, at start-up, so a wrong one is refused with its
    key path; once serving, changed files are reloaded every ``reload_s``.
    """

    cert_file: NonEmpty
    key_file: NonEmpty
    # Mutual TLS: a client must present a certificate this CA signed.
    client_ca_file: NonEmpty | None = None
    reload_s: Positive = 5.0

    def problems(self) -> Iterator[tuple[str, str]]:
        try:
            load_context(self.cert_file, self.key_file, self.client_ca_file)
        except TlsFileError as exc:
            yield exc.key, exc.message


class Listen(_Section, frozen=True):
    """Where the processor listens: gRPC for Envoy (TLS with a ``tls`` section), HTTP for Prometheus."""

    grpc: Address = "127.0.0.1:50051"
    metrics: Address = "127.0.0.1:9464"
    tls: TlsSettings | None = None
    # The gRPC port's bounds on what one peer can hold (adapters/ext_proc/transport.py Limits); far
    # above what Envoy's held requests need, each held request being one stream.
    max_streams_per_connection: Count = 100_000
    max_connections: Count = 1_000
    connection_buffer_bytes: Count = 32 * 1024 * 1024
    idle_timeout_s: Positive = 3600.0
    handshake_timeout_s: Positive = 10.0
    # The gRPC server under ext_proc: ours on h2 (~3 KB a held request) or grpc.aio, the reference
    # (~24 KB; docs/reliability.md, "Choosing the transport").
    transport: Literal["h2", "grpcio"] = "h2"


class Identity(_Section, frozen=True):
    """Headers that carry who is asking, for what, and how urgently.

    The tenant header must be set by a trusted Envoy auth filter (api_key_auth,
    jwt_authn) that overwrites anything the client sent.
    """

    tenant_header: Header = "x-tenant-id"
    priority_header: Header = "x-priority"
    model_header: Header = "x-model"
    default_tenant: NonEmpty = "anonymous"
    # A request without the tenant header: served as `default_tenant`, or refused with 401.
    missing_tenant: Literal["default", "reject"] = "default"
    # The Gateway API Inference Extension's conventions (docs/epp.md). The fairness id is
    # read as the tenant where tenant_header is absent, so list only headers the gateway in
    # front sets and overwrites (its auth): a client must not choose its own tenant.
    fairness_id_headers: tuple[Header, ...] = ()
    # The request's objective, mapped to a class by `objectives`; like priority_header it is
    # the client's wish, limited by the tenant's entitlement.
    objective_headers: tuple[Header, ...] = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
    objectives: dict[NonEmpty, NonEmpty] = msgspec.field(default_factory=dict)
    # A time-to-first-token objective in milliseconds, carried with the request to the scheduler.
    ttft_headers: tuple[Header, ...] = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
    # A request that says it is a retry (a value other than 0) is never preempted, so a
    # preempted request runs when it comes back. The OpenAI SDKs send the first on every retry.
    retry_headers: tuple[Header, ...] = ("x-stainless-retry-count",)


class CostSettings(_Section, frozen=True):
    """How the `vtc` policy prices a request (defaults: the core's :class:`~extproc.core.cost.CostWeights`)."""

    input_weight: NonNegative = CostWeights.input_weight
    output_weight: NonNegative = CostWeights.output_weight
    bytes_per_token: Positive = CostWeights.bytes_per_token
    body_overhead_bytes: Count0 = CostWeights.body_overhead_bytes
    default_output_tokens: Count = CostWeights.default_output_tokens

    def weights(self) -> CostWeights:
        return CostWeights(**msgspec.structs.asdict(self))

    def problems(self) -> Iterator[tuple[str, str]]:
        if self.input_weight == 0 and self.output_weight == 0:
            # Every request would cost nothing: vtc's counters would never move.
            yield "", "input_weight and output_weight cannot both be 0"


class PrefixSettings(_Section, frozen=True):
    """Prefix signatures for a model (adapters/ext_proc/prompt_prefix.py, core/prefix.py).

    Present, the processor reads each request's body before it holds it (one
    more ext_proc message behind the generated Envoy) to hash its prompt's
    leading blocks; absent, the body never reaches Python (the fast path).
    """

    # Tokens one block covers; need not be the engine's KV block (vLLM --block-size: 16 on a GPU,
    # 128 on CPU): block_tokens x max_blocks is how much of a prompt is seen (docs/locality.md).
    # A block is block_tokens x cost.bytes_per_token bytes of text.
    block_tokens: Count = 128
    # How many leading blocks are hashed: bounds the cost per request whatever the prompt.
    max_blocks: Annotated[int, Meta(ge=1, le=256)] = 16
    # The price of a cached prompt token, against cost.input_weight for an uncached one.
    cached_input_weight: NonNegative = CostWeights.cached_input_weight


class ModelConfig(_Section, frozen=True):
    """One model pool: the endpoints that serve it and how hard to fill them."""

    name: NonEmpty
    endpoints: Annotated[tuple[Endpoint, ...], Meta(min_length=1)]
    # Other model names these engines serve (LoRA adapters, aliases): exact names or shell-style
    # patterns (`llama-3-lora-*`). Every name shares this model's gate and fair queues; the
    # name itself only routes and reports.
    served_names: tuple[NonEmpty, ...] = ()
    engine: Annotated[str, choice(ENGINES)] = "vllm"
    target_waiting: Count = 3
    scrape_interval_s: Positive = 0.1
    # Metrics older than this are not trusted (the engine may have moved on).
    stale_after_s: Positive = 1.0
    # In-flight floor per endpoint while the engine's metrics cannot be read.
    fallback_max_in_flight: Count = 4
    # A request still queued after this long is answered 503 instead of held
    # (a band's own max_queue_wait_s overrides it).
    max_queue_wait_s: Positive = 120.0
    # How releases are decided (docs/gate.md).
    gate: Annotated[str, choice(RULES)] = "adaptive"
    # Optional ceilings for the adaptive gate.
    max_inter_token_latency_ms: Positive | None = None
    max_kv_usage: Share | None = None
    # Inter-token latency is averaged over this much recent time.
    itl_window_s: Positive = 2.0
    # Per endpoint: hard cap on what the engine may hold (adaptive), or on our
    # in-flight requests (static_concurrency, where it is required).
    max_in_flight: Count | None = None
    # Requests per second for the whole pool (static_rate, required there).
    release_rate: Positive | None = None
    # Pick the endpoint of each release and tell Envoy (x-gateway-destination-endpoint).
    endpoint_picking: bool = False
    # Endpoints given by host name are resolved this often; each address is an endpoint.
    dns_refresh_s: Positive = 10.0
    # Which tenant goes next inside a band (extproc/core/policies).
    policy: Annotated[str, choice(POLICIES)] = "round_robin"
    # Requests this model may hold in all; one more is answered 503.
    max_queued: Count = 10_000
    # Of the engine's queue room beyond its free slots, what bands below the first
    # leave to the bands above while those have work now (requests held or arriving),
    # so a chat finds a place in the engine's queue without waiting for a slot;
    # free slots themselves are never kept back (core/bands.py).
    reserved_waiting: Count0 = 0
    # Write the band's numeric priority into the body's `priority` (vLLM
    # --scheduling-policy priority); only such models (and those with `prefix`) have their body sent to us.
    engine_priority: bool = False
    # The most preemptions (of a preemptible band's requests, for a higher band whose
    # objective is at risk) per second; 0: never preempt.
    max_preemptions_per_s: NonNegative = 2.0
    # The engine's batch size (vLLM --max-num-seqs), if known; else learned from its metrics.
    max_running: Count | None = None
    # The engine's context length (vLLM --max-model-len): the most tokens one
    # request can hold. The `vtc` cost estimate clamps a request's prompt and
    # output to it, so a client's `max_tokens: 1e308` costs what the largest
    # real request could, not infinity (docs/policies.md).
    max_context_tokens: Count = CostWeights.max_context_tokens
    cost: CostSettings = msgspec.field(default_factory=CostSettings)
    # Prefix signatures of the requests' prompts (absent: none, unless policy is locality,
    # which gets the defaults: _parse fills it in).
    prefix: PrefixSettings | None = None

    def cost_weights(self) -> CostWeights:
        """How the `vtc` policy prices this model's requests: the cost section, the context length, the cached price."""
        cached = self.prefix.cached_input_weight if self.prefix else CostWeights.cached_input_weight
        return replace(self.cost.weights(), max_context_tokens=self.max_context_tokens, cached_input_weight=cached)

    def problems(self) -> Iterator[tuple[str, str]]:
        rule = RULES[self.gate]
        for required in rule.requires:
            if getattr(self, required) is None:
                yield required, f"is required with gate: {rule.name}"
        if self.endpoint_picking and not rule.per_endpoint:
            yield "endpoint_picking", f"does not work with gate: {rule.name} (no per-endpoint state)"
        if self.endpoint_picking and any(e.startswith("https:") for e in self.endpoints):
            yield "endpoint_picking", "needs http:// endpoints (the picked-endpoint cluster is plain HTTP)"
        if self.prefix is not None and self.prefix.cached_input_weight > self.cost.input_weight:
            yield "prefix.cached_input_weight", (f"must not exceed cost.input_weight ({self.cost.input_weight:g}): "
                                                 "a cached prompt token costs the engine less, not more")


class BandSettings(_Section, frozen=True):
    """One band's entry as written, its fields named as :class:`~extproc.core.bands.Band`' (which documents them).

    An unset field takes the core's default, except where that depends on
    the band's place (:func:`_bands`).
    """

    max_queue_wait_s: Positive | None = None
    max_queued: Count | None = None
    idle_only: bool | None = None
    idle_running_share: Share = Band.idle_running_share
    engine_priority: int | None = None
    ttft_objective_s: Positive | None = None
    min_ttft_objective_s: Positive | None = None
    preemptible: bool | None = None
    min_share: ReleaseShare | None = None


class TenantSettings(_Section, frozen=True):
    """A tenant's entry as written; unset fields are inherited from the `default` entry.

    Its fields are named as :class:`~extproc.core.entitlement.Tenant`'s, except
    the two the file names for priorities (``priorities``, ``default_priority``).
    """

    weight: Positive | None = None
    priorities: Names | None = None
    default_priority: NonEmpty | None = None
    max_queued: Count | None = None


class JwtSettings(_Section, frozen=True):
    """Envoy's jwt_authn: a verified token's claim names the tenant."""

    issuer: NonEmpty
    audiences: tuple[NonEmpty, ...] = ()
    # Exactly one: a JWKS document inline (JSON text, or YAML), or the URL Envoy fetches it from.
    jwks: Jwks | None = None
    jwks_uri: HttpUrl | None = None
    tenant_claim: NonEmpty = "sub"

    def problems(self) -> Iterator[tuple[str, str]]:
        if (self.jwks is None) == (self.jwks_uri is None):
            yield "", "needs exactly one of jwks (an inline JWKS) or jwks_uri (where Envoy fetches it)"


class EndpointPickerSettings(_Section, frozen=True):
    """The Endpoint Picker Protocol's knobs, for requests attached by ext_proc alone (docs/epp.md)."""

    # A body read from the stream larger than this is refused 413.
    max_body_bytes: Count = 10 * 1024 * 1024
    # The status of a request shed under load (queue full, timed out, overloaded): the protocol's 429.
    shed_status: Literal[429, 503] = 429
    # Endpoints named after the pick, in order of preference, so a dead one costs a retry. Only
    # for a gateway whose pool cluster walks the list (Envoy's override_host policy): an
    # ORIGINAL_DST cluster (Envoy AI Gateway) takes one address and fails a list with 503.
    fallbacks: Count0 = 0


# The admission bucket's refill as a share of the processor's intake (EnvoySettings.admission_tokens).
ADMISSION_REFILL_SHARE = Fraction(2, 3)


class EnvoySettings(_Section, frozen=True):
    """What `extproc envoy-config` needs to print a complete bootstrap."""

    listen: Address = "127.0.0.1:10000"
    admin: Address = "127.0.0.1:9901"
    # API key -> tenant, for Envoy's api_key_auth filter (demo-grade identity).
    api_keys: dict[str, NonEmpty] = msgspec.field(default_factory=dict)
    # Envoy's per-message timeout: short enough that a hung processor is noticed within
    # seconds (a crashed one is noticed at once: its connection resets), long enough
    # that a busy event loop under a burst does not turn into 504s.
    message_timeout_ms: Count = 2000
    # When the processor cannot be reached (crashed, restarting, hung past the message
    # timeout): "closed" answers 503 (nothing passes unscheduled); "open" forwards the
    # request unscheduled, routed on the body's model (nothing is lost, fairness is).
    processor_failure: Literal["closed", "open"] = "closed"
    # Admission in front of the processor (Envoy's local rate limit, one token bucket): up to
    # admission_burst requests at once, then admission_per_second. Sized to the processor's
    # intake, what it takes in of a burst per second within message_timeout_ms (3,000 in 2 s on a
    # loaded 2-core machine: 1,500/s). admission_per_second is 2/3 of it, since requests that
    # keep arriving while a burst is taken in add to it; unset, admission_burst is the intake x
    # the timeout (3,000 at 2 s), so a longer timeout takes in a larger burst. Beyond that,
    # Envoy answers 503 `overloaded` at once rather than let streams outrun the message timeout
    # (docs/reliability.md, "Bursts and the admission bucket").
    admission_burst: Count | None = None
    admission_per_second: Count = 1000
    # Production-grade identity: a bearer JWT verified by Envoy (exclusive with api_keys).
    jwt: JwtSettings | None = None
    # With listen.tls: the CA Envoy checks the processor's certificate against (without it, any
    # certificate is accepted, as Gateway API Inference Extension gateways do), and the certificate
    # Envoy presents when listen.tls.client_ca_file asks for one. Paths as Envoy sees them.
    processor_ca_file: NonEmpty | None = None
    processor_client_cert_file: NonEmpty | None = None
    processor_client_key_file: NonEmpty | None = None

    @property
    def admission_tokens(self) -> int:
        """The bucket's size: ``admission_burst``, else what the processor takes in within the message timeout."""
        if self.admission_burst is not None:
            return self.admission_burst
        intake_per_s = self.admission_per_second / ADMISSION_REFILL_SHARE
        return math.ceil(intake_per_s * self.message_timeout_ms / 1000)

    def problems(self) -> Iterator[tuple[str, str]]:
        if self.api_keys and self.jwt is not None:
            yield "jwt", "use either api_keys or jwt for identity, not both"
        if self.processor_client_cert_file is None and self.processor_client_key_file is not None:
            yield "processor_client_cert_file", "is required with processor_client_key_file"
        if self.processor_client_key_file is None and self.processor_client_cert_file is not None:
            yield "processor_client_key_file", "is required with processor_client_cert_file"


SHARD_NAME = r"[A-Za-z0-9_-]+"
# Cluster instance names follow the shard rule: safe in file names, metric labels and Redis keys.
INSTANCE_NAME = SHARD_NAME


class Shard(_Section, frozen=True):
    """One processor instance of a sharded deployment: where it listens and the models it alone schedules.

    Every instance runs the same file with ``extproc serve --shard NAME``;
    its ``listen`` is the shard's, its models only the shard's (docs/cluster.md).
    ``grpc`` is also where Envoy reaches it (a wildcard host means loopback).
    """

    grpc: Address
    metrics: Address
    models: Names


class ClusterInstance(_Section, frozen=True):
    """One active-active instance: where it listens (``extproc serve --instance NAME``).

    ``grpc`` is also where Envoy reaches it (a wildcard host means loopback).
    """

    grpc: Address
    metrics: Address


class ClusterSettings(_Section, frozen=True):
    """Active-active: instances that share each engine's limit and the fairness counters through Redis.

    Instances whose files are identical except ``listen`` and that name the
    same ``redis_url`` (and ``key_prefix``) form one cluster (docs/cluster.md).
    """

    redis_url: RedisUrl
    # Every Redis key starts with this, so several clusters can share one Redis.
    key_prefix: NonEmpty = "extproc"
    # An instance's in-flight reservations lapse this long after its last word:
    # the slots of a dead instance come back.
    lease_s: Positive = 2.0
    # How often an idle instance renews its lease (a busy one renews with its releases).
    heartbeat_s: Positive = 0.5
    # A Redis call slower than this counts as Redis unreachable (the instance goes degraded).
    redis_timeout_ms: Count = 250
    # Optional: instance name -> its addresses, for `serve --instance` and Envoy's cluster.
    instances: dict[str, ClusterInstance] = msgspec.field(default_factory=dict)

    def problems(self) -> Iterator[tuple[str, str]]:
        if self.heartbeat_s >= self.lease_s / 2:
            # One late heartbeat must not let a live instance's lease lapse.
            yield "heartbeat_s", f"must be below lease_s / 2 ({self.lease_s / 2:g}), got {self.heartbeat_s:g}"
        for name in self.instances:
            if not re.fullmatch(INSTANCE_NAME, name):
                yield f"instances.{name}", "an instance name may only use A-Z, a-z, 0-9, _ and -"


class ConfigFile(_Section, frozen=True):
    """The whole file, as written."""

    models: Annotated[tuple[ModelConfig, ...], Meta(min_length=1)]
    listen: Listen = msgspec.field(default_factory=Listen)
    identity: Identity = msgspec.field(default_factory=Identity)
    # Highest first.
    priorities: Names = ("interactive", "standard", "batch")
    # None: `standard` if there is one, else the lowest class.
    default_priority: NonEmpty | None = None
    envoy: EnvoySettings = msgspec.field(default_factory=EnvoySettings)
    # By class name.
    bands: dict[str, BandSettings] = msgspec.field(default_factory=dict)
    # By tenant name; `default` is every other tenant's template.
    tenants: dict[str, TenantSettings] = msgspec.field(default_factory=dict)
    # Per-model sharding: shard name -> the instance that owns some models (docs/cluster.md).
    shards: dict[str, Shard] = msgspec.field(default_factory=dict)
    # Active-active: several instances that behave as one, sharing state in Redis (docs/cluster.md).
    cluster: ClusterSettings | None = None
    endpoint_picker: EndpointPickerSettings = msgspec.field(default_factory=EndpointPickerSettings)

    def problems(self) -> Iterator[tuple[str, str]]:
        yield from _shard_problems(self)
        for key in ("processor_ca_file", "processor_client_cert_file", "processor_client_key_file"):
            if self.listen.tls is None and getattr(self.envoy, key) is not None:
                yield f"envoy.{key}", "needs listen.tls (the processor's gRPC port is plaintext without it)"
        if self.cluster is not None:
            yield from _address_problems("cluster.instances", self.cluster.instances)
        if self.cluster is not None and self.shards:
            yield "cluster", ("use either cluster: (active-active) or shards: (per-model sharding), not both "
                              "(docs/cluster.md)")
        for i, model in enumerate(self.models):
            if self.cluster is not None and POLICIES[model.policy].cluster is None:
                # The cluster's script runs a policy's cluster form, not its own pick (core/policies/base.py).
                forms = ", ".join(n for n, p in POLICIES.items() if p.cluster is not None)
                yield f"models[{i}].policy", (f"{model.policy} has no cluster form, so a cluster cannot run it: "
                                              f"use {forms} (docs/cluster.md)")
            if self.cluster is not None and model.gate == "static_rate":
                # A rate is not a count in flight: there is nothing to lease, so no share to keep.
                yield f"models[{i}].gate", ("static_rate cannot be shared by a cluster: use adaptive, waiting_target "
                                            "or static_concurrency (docs/cluster.md)")
        classes = self.priorities
        if len(set(classes)) != len(classes):
            yield "priorities", f"must not repeat a class, got {list(classes)}"
        if self.default_priority is not None and self.default_priority not in classes:
            yield "default_priority", f"must be one of priorities {list(classes)}, got {self.default_priority!r}"
        yield from _name_problems(self)
        for objective, band in self.identity.objectives.items():
            if band not in classes:
                yield f"identity.objectives.{objective}", f"must be one of priorities {list(classes)}, got {band!r}"
        for name in self.bands:
            if name not in classes:
                yield f"bands.{name}", f"unknown key (allowed: {', '.join(sorted(classes))})"
        wrong = [p for name, tenant in self.tenants.items() for p in _tenant_problems(tenant, f"tenants.{name}", classes)]
        yield from wrong
        if not wrong and (self.default_priority is None or self.default_priority in classes):
            yield from _entitlement_problems(self)


def _name_problems(file: ConfigFile) -> Iterator[tuple[str, str]]:
    """A model name (or exact served name) belongs to one model: requests for it must find one gate."""
    owner: dict[str, int] = {}
    for i, model in enumerate(file.models):
        for key, name in [("name", model.name), *((f"served_names[{j}]", n) for j, n in enumerate(model.served_names))]:
            if name in owner and (owner[name] != i or key == "name"):
                yield f"models[{i}].{key}", f"duplicate model name {name!r} (models[{owner[name]}] serves it)"
            owner.setdefault(name, i)


def _shard_problems(file: ConfigFile) -> Iterator[tuple[str, str]]:
    """With shards, every model has exactly one owner and no two instances share an address."""
    if not file.shards:
        return
    names = {m.name for m in file.models}
    owner: dict[str, str] = {}
    for shard, settings in file.shards.items():
        if not re.fullmatch(SHARD_NAME, shard):
            yield f"shards.{shard}", "a shard name may only use A-Z, a-z, 0-9, _ and - (it names an Envoy cluster)"
        for i, owned in enumerate(settings.models):
            if owned not in names:
                yield f"shards.{shard}.models[{i}]", f"no model {owned!r} in models"
            elif owned in owner:
                yield f"shards.{shard}.models[{i}]", f"model {owned!r} is already owned by shard {owner[owned]!r}"
            else:
                owner[owned] = shard
    yield from _address_problems("shards", file.shards)
    for i, model in enumerate(file.models):
        if model.name not in owner:
            yield f"models[{i}].name", f"{model.name!r} is in no shard (with shards, every model needs one)"


def _address_problems(section: str, instances: dict[str, Shard] | dict[str, ClusterInstance]) -> Iterator[tuple[str, str]]:
    """No two instances (nor one instance's two listeners) on the same address."""
    seen: dict[str, str] = {}
    for name, settings in instances.items():
        for key in ("grpc", "metrics"):
            address = getattr(settings, key)
            if address in seen:
                yield f"{section}.{name}.{key}", f"{address} is already used by {seen[address]}"
            seen[address] = f"{section}.{name}.{key}"


def _tenant_problems(tenant: TenantSettings, path: str, classes: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """A tenant may only name the configured classes."""
    for i, name in enumerate(tenant.priorities or ()):
        if name not in classes:
            yield f"{path}.priorities[{i}]", f"must be one of priorities {list(classes)}, got {name!r}"
    if tenant.default_priority is not None and tenant.default_priority not in classes:
        yield f"{path}.default_priority", f"must be one of priorities {list(classes)}, got {tenant.default_priority!r}"


def _entitlement_problems(file: ConfigFile) -> Iterator[tuple[str, str]]:
    """A tenant's default band, inherited or not, must be one it may use."""
    template, named = _tenants(file)
    for name, tenant in ((DEFAULT_TENANT_KEY, template), *named.items()):
        if tenant.default_band not in tenant.bands:
            yield (f"tenants.{name}.default_priority",
                   f"{tenant.default_band!r} is not among the tenant's priorities {list(tenant.bands)}; "
                   "set default_priority")


# --- what the program reads --------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """The configuration as the program uses it: each band's settings resolved, each tenant's inherited.

    The file's own shape (:class:`ConfigFile`) keeps what was written, so
    errors can name its keys; this view is what everything else reads, so no
    reader repeats the defaults or the inheritance.
    """

    listen: Listen
    identity: Identity
    # The bands' names, highest first.
    band_names: tuple[str, ...]
    models: tuple[ModelConfig, ...]
    envoy: EnvoySettings
    # One per band, in the order of `band_names`.
    bands: tuple[Band, ...]
    # Explicitly configured tenants; every other tenant gets `default_tenant`.
    tenants: dict[str, Tenant]
    default_tenant: Tenant
    # Per-model sharding (empty: one processor owns every model).
    shards: dict[str, Shard] = field(default_factory=dict)
    # Active-active (None: this instance alone schedules its models).
    cluster: ClusterSettings | None = None
    endpoint_picker: EndpointPickerSettings = field(default_factory=EndpointPickerSettings)

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def tenant(self, name: str) -> Tenant:
        return self.tenants.get(name, self.default_tenant)

    def longest_queue_wait_s(self, model: ModelConfig) -> float:
        """The longest any request may stay queued for ``model``, whatever its band."""
        return max(band.queue_wait_s(model.max_queue_wait_s) for band in self.bands)

    def envoy_problems(self) -> list[str]:
        """What only the generated Envoy config needs, each with its key path (envoy-config refuses, check-config reports).

        ``serve`` does not refuse these: behind a gateway that writes its own
        Envoy config (docs/epp.md) the processor may ask any client for a
        certificate, and it reads every endpoint whatever its scheme.
        """
        problems = []
        tls = self.listen.tls
        if tls is not None and tls.client_ca_file is not None and self.envoy.processor_client_cert_file is None:
            problems.append("envoy.processor_client_cert_file: is required with listen.tls.client_ca_file "
                            "(the processor asks Envoy for a certificate)")
        problems += [f"models[{i}].endpoints: mixes http and https; use one scheme per model"
                     for i, model in enumerate(self.models) if len({urlsplit(e).scheme for e in model.endpoints}) > 1]
        return problems

    def shard_of(self, model: str) -> str | None:
        """The shard that owns ``model`` (None without shards)."""
        return next((name for name, shard in self.shards.items() if model in shard.models), None)

    def for_shard(self, name: str | None) -> Config:
        """What one instance serves: with shards, ``name``'s models on ``name``'s addresses.

        Without shards, ``name`` must be None; with shards it is required, so
        an instance can neither serve every model by accident nor a shard
        that does not exist.
        """
        if not self.shards:
            if name is not None:
                raise ConfigError(f"--shard {name}: the config has no shards: section")
            return self
        choices = ", ".join(self.shards)
        if name is None:
            raise ConfigError(f"shards: the config is sharded; run each instance with --shard NAME (one of: {choices})")
        shard = self.shards.get(name)
        if shard is None:
            raise ConfigError(f"--shard {name}: no such shard in shards: (one of: {choices})")
        models = tuple(m for m in self.models if m.name in shard.models)
        return replace(self, listen=msgspec.structs.replace(self.listen, grpc=shard.grpc, metrics=shard.metrics),
                       models=models)

    def for_instance(self, name: str | None) -> Config:
        """What one active-active instance serves: the same models, on ``name``'s addresses.

        With ``cluster.instances`` listed, ``name`` picks the instance's
        ``listen``; without ``name`` the file's own ``listen`` is used, so N
        files identical except ``listen`` work as well. A name the file does
        not list is refused rather than ignored: the instance would
        otherwise listen where another one does.
        """
        instances = self.cluster.instances if self.cluster is not None else {}
        if name is None:
            return self
        if not instances:
            raise ConfigError(f"--instance {name}: the config has no cluster.instances: section")
        instance = instances.get(name)
        if instance is None:
            raise ConfigError(f"--instance {name}: no such instance in cluster.instances "
                              f"(one of: {', '.join(instances)})")
        return replace(self, listen=msgspec.structs.replace(self.listen, grpc=instance.grpc, metrics=instance.metrics))


def _default_priority(file: ConfigFile) -> str:
    if file.default_priority is not None:
        return file.default_priority
    return "standard" if "standard" in file.priorities else file.priorities[-1]


def _written(section: _Section) -> dict[str, Any]:
    """The fields of ``section`` that are set, by name (None: unset)."""
    return {key: value for key, value in msgspec.structs.asdict(section).items() if value is not None}


def _bands(file: ConfigFile) -> tuple[Band, ...]:
    """Each band's settings as written, over the defaults that depend on its place.

    The lowest of several bands is idle-only and preemptible, with no minimum
    share (it may wait as long as the bands above keep the engine busy); a
    band's engine priority is its position (vLLM runs lower numbers first). The
    first of several bands has a TTFT objective of 5 s (people give up after
    about that long without progress), the middle ones 60 s (they expect a
    wait), the lowest none.
    """
    count = len(file.priorities)

    def defaults(index: int) -> dict[str, Any]:
        lowest = count > 1 and index == count - 1
        objective = None if count == 1 or lowest else (5.0 if index == 0 else 60.0)
        return {"idle_only": lowest, "preemptible": lowest, "engine_priority": index, "ttft_objective_s": objective,
                **({"min_share": 0.0} if lowest else {})}

    return tuple(
        Band(**{"name": name, **defaults(index), **_written(file.bands.get(name, BandSettings()))})
        for index, name in enumerate(file.priorities)
    )


def _tenant(written: TenantSettings, base: Tenant, bands: tuple[str, ...]) -> Tenant:
    """``written`` over ``base``, field by field; the bands it may use are kept highest first, whatever the order written."""
    fields = _written(written)
    allowed = fields.pop("priorities", None)
    default = fields.pop("default_priority", None)
    return replace(
        base, **fields,
        bands=base.bands if allowed is None else tuple(b for b in bands if b in allowed),
        default_band=base.default_band if default is None else default,
    )


def _tenants(file: ConfigFile) -> tuple[Tenant, dict[str, Tenant]]:
    """The `default` template (inherited field by field) and the named tenants."""
    every = Tenant(bands=file.priorities, default_band=_default_priority(file))
    template = _tenant(file.tenants.get(DEFAULT_TENANT_KEY, TenantSettings()), every, file.priorities)
    named = {name: _tenant(written, template, file.priorities)
             for name, written in file.tenants.items() if name != DEFAULT_TENANT_KEY}
    return template, named


def _with_prefix(model: ModelConfig) -> ModelConfig:
    """``policy: locality`` orders by prefix signatures: without a ``prefix:`` section it gets the defaults."""
    if model.prefix is None and model.policy == "locality":
        return msgspec.structs.replace(model, prefix=PrefixSettings())
    return model


def parse_config(raw: Any) -> Config:
    """Validate an already-loaded YAML document; a ConfigError lists every mistake."""
    try:
        return _parse(raw)
    except Invalid as exc:
        raise ConfigError(*exc.errors) from None


def _parse(raw: Any) -> Config:
    """``raw`` as the program reads it; :class:`Invalid` lists every mistake with its key path."""
    file = convert(raw, ConfigFile)
    default_tenant, tenants = _tenants(file)
    return Config(
        listen=file.listen,
        identity=file.identity,
        band_names=file.priorities,
        models=tuple(_with_prefix(m) for m in file.models),
        envoy=file.envoy,
        bands=_bands(file),
        tenants=tenants,
        default_tenant=default_tenant,
        shards=dict(file.shards),
        cluster=file.cluster,
        endpoint_picker=file.endpoint_picker,
    )


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML file; every failure is a ConfigError, each line ``FILE:LINE: key.path: problem``.

    The line is where the offending key (or list item) is written; a missing
    key points at the mapping that lacks it. The lines come from PyYAML's
    node tree (its start marks), composed once and then constructed, so the
    file is parsed a single time.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    return parse_config_text(path, text)


def parse_config_text(path: str | Path, text: str) -> Config:
    """The file ``path`` whose content is ``text`` (already read: a reload hashes what it parses), as load_config."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        raw = None if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(_yaml_error(path, exc)) from None
    finally:
        loader.dispose()
    try:
        return _parse(raw)
    except Invalid as exc:
        lines = _key_lines(node)
        located = sorted(((_line(lines, key), error) for (key, _), error in zip(exc.problems, exc.errors, strict=True)),
                         key=lambda pair: pair[0])  # in the file's order, for reading top to bottom
        raise ConfigError(*(f"{path}:{line}: {error}" for line, error in located)) from None


def _yaml_error(path: str | Path, exc: yaml.MarkedYAMLError) -> str:
    """PyYAML's error as one line naming the file (its own says ``<unicode string>``)."""
    mark = exc.problem_mark or exc.context_mark
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    context = f" ({exc.context})" if exc.context else ""
    return f"{where}: not valid YAML: {exc.problem}{context}"


def _key_lines(root: yaml.Node | None) -> dict[str, int]:
    """Key path (as validate.py spells it) -> the 1-based line where it is written."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                child = f"{path}.{key.value}" if path else str(key.value)
                lines.setdefault(child, key.start_mark.line + 1)
                walk(value, child)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                child = f"{path}[{i}]"
                lines.setdefault(child, item.start_mark.line + 1)
                walk(item, child)

    if root is not None:
        lines[""] = root.start_mark.line + 1
        walk(root, "")
    return lines


def _line(lines: dict[str, int], key: str) -> int:
    """The line of ``key``, else of the nearest enclosing key that is written (1 for an empty file)."""
    while key not in lines and key:
        key = key[: max(key.rfind("."), key.rfind("["), 0)]
    return lines.get(key, 1)
