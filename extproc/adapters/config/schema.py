"""The file's shape: one msgspec struct per section, the constraints in their annotations.

:class:`ConfigFile` is the file as written. Each field's type says what its
value must be (values.py); unknown keys are refused (a misspelt
``taget_waiting`` silently falling back to its default is the kind of surprise
an operator finds only under load). The rules between fields are apart, in
rules.py, and what the program reads is :class:`~.resolve.Config`, resolved
from this shape by resolve.py.

A band's and a tenant's settings are named as the core's own types
(:class:`~extproc.core.bands.Band`, :class:`~extproc.core.entitlement.Tenant`),
so a new band or tenant setting is a field here and one in the core's type.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from extproc.adapters.config.advanced import GRPC_LIMITS, MODEL_ADVANCED, AdvancedSettings, ModelAdvanced
from extproc.adapters.config.batches import BatchSettings
from extproc.adapters.config.budgets import BudgetSettings
from extproc.adapters.config.instances import ClusterSettings, Shard
from extproc.adapters.config.values import (
    Address,
    Count,
    Count0,
    Endpoint,
    Header,
    HttpUrl,
    Jwks,
    Names,
    NonEmpty,
    NonNegative,
    Positive,
    ReleaseShare,
    ReserveShare,
    Section,
    Share,
    choice,
)
from extproc.adapters.protocol.contract import MODEL_HEADER
from extproc.adapters.protocol.dialects import DIALECTS
from extproc.core.bands import Band
from extproc.core.cost import CostWeights
from extproc.core.policies import POLICIES
from extproc.core.release import RULES

# The engines whose /metrics the gate reads (adapters/protocol/dialects.py owns the list).
ENGINES = tuple(DIALECTS)


class TlsSettings(Section, frozen=True):
    """TLS on the gRPC port (adapters/grpc/tls.py): the processor's certificate, and optionally the clients' CA.

    The files are loaded when the file is checked (rules.py), so a wrong one is
    refused with its key path; once serving, changed files are reloaded every ``reload_s``.
    """

    cert_file: NonEmpty
    key_file: NonEmpty
    # Mutual TLS: a client must present a certificate this CA signed.
    client_ca_file: NonEmpty | None = None
    reload_s: Positive = 5.0


log = logging.getLogger(__name__)

# The gRPC servers `listen.transport` names (adapters/transports.py TRANSPORTS): `builtin`, ours, built into the
# package (adapters/grpc/builtin/: its own HTTP/2 layer), and `grpcio`, grpc.aio. And `h2`, the name ours had when it
# ran on the `h2` library, still read as `builtin` with a warning.
TRANSPORT_NAMES = ("builtin", "grpcio")
OLD_TRANSPORT_NAMES = {"h2": "builtin"}


def _transport(value: str) -> str:
    """A transport's name; its old name is read as the new one, with a warning."""
    if value in OLD_TRANSPORT_NAMES:
        new = OLD_TRANSPORT_NAMES[value]
        log.warning("listen.transport: %r is the old name of %r (our own gRPC server, which no longer runs on "
                    "the h2 library); read as %r, write %r", value, new, new, new)
        return new
    if value not in TRANSPORT_NAMES:
        raise ValueError(value)
    return value


TransportName = Annotated[str, Meta(description=f"one of {', '.join(TRANSPORT_NAMES)} (h2: builtin's old name)",
                                    extra={"check": _transport})]


class Listen(Section, frozen=True):
    """Where the processor listens: gRPC for Envoy (TLS with a ``tls`` section), HTTP for Prometheus."""

    grpc: Address = "127.0.0.1:50051"
    metrics: Address = "127.0.0.1:9464"
    tls: TlsSettings | None = None
    # The gRPC server under ext_proc: `builtin`, ours, built into the package on its own HTTP/2 layer (not the h2
    # library; ~4 KB a held request), or `grpcio`, grpc.aio, the reference (~24 KB; docs/decisions.md, "When to
    # choose grpcio"). `h2`, builtin's old name, is read as `builtin` with a warning.
    transport: TransportName = "builtin"

    REMOVED = {key: f"moved to advanced.grpc.{key}" for key in GRPC_LIMITS}


class Identity(Section, frozen=True):
    """Headers that carry who is asking, for what, and how urgently.

    The tenant header must be set by a trusted Envoy auth filter (api_key_auth,
    jwt_authn) that overwrites anything the client sent.
    """

    tenant_header: Header = "x-tenant-id"
    priority_header: Header = "x-priority"
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

    REMOVED = {"model_header": f"is no longer a setting: the processor sets {MODEL_HEADER}, the header the generated "
                               "Envoy (and deploy/'s manifests) route on; remove the key"}


class CostSettings(Section, frozen=True):
    """How the `vtc` policy prices a request (defaults: the core's :class:`~extproc.core.cost.CostWeights`)."""

    input_weight: NonNegative = CostWeights.input_weight
    output_weight: NonNegative = CostWeights.output_weight
    bytes_per_token: Positive = CostWeights.bytes_per_token
    body_overhead_bytes: Count0 = CostWeights.body_overhead_bytes
    default_output_tokens: Count = CostWeights.default_output_tokens

    def weights(self) -> CostWeights:
        return CostWeights(**msgspec.structs.asdict(self))


class PrefixSettings(Section, frozen=True):
    """Prefix signatures for a model (adapters/request/prompt_prefix.py, core/prefix.py).

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


class ModelConfig(Section, frozen=True):
    """One model pool: the endpoints that serve it and how hard to fill them."""

    name: NonEmpty
    endpoints: Annotated[tuple[Endpoint, ...], Meta(min_length=1)]
    # Other model names these engines serve (LoRA adapters, aliases): exact names or shell-style
    # patterns (`llama-3-lora-*`). Every name shares this model's gate and fair queues; the
    # name itself only routes and reports.
    served_names: tuple[NonEmpty, ...] = ()
    engine: Annotated[str, choice(ENGINES)] = "vllm"
    target_waiting: Count = 3
    # A request still queued after this long is answered 503 instead of held
    # (a band's own max_queue_wait_s overrides it).
    max_queue_wait_s: Positive = 120.0
    # While no engine of the pool is up (scaled to zero, starting, every one down), a queued request
    # is kept past its class's wait up to this long from its arrival, then answered 503 (unset: max_queue_wait_s).
    cold_start_wait_s: Positive | None = None
    # How releases are decided (docs/gate.md).
    gate: Annotated[str, choice(RULES)] = "adaptive"
    # Optional ceilings for the adaptive gate.
    max_inter_token_latency_ms: Positive | None = None
    max_kv_usage: Share | None = None
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
    # so a chat does not wait behind them in an engine that serves its queue in arrival
    # order; free slots themselves are never kept back (core/bands.py). Unset:
    # target_waiting - 1, so a lower band keeps one request waiting to fill the next
    # free slot. Not used where the engine orders its queue by priority (engine_priority).
    reserved_waiting: Count0 | None = None
    # Write the band's numeric priority into the body's `priority`, so an engine that
    # orders its waiting queue by priority (vLLM --scheduling-policy priority) runs the
    # classes in order inside it, and the gate counts what lower classes queue there as
    # passed. auto: where the engine says it does (its info endpoint, adapters/engines/limits.py);
    # only those models (and those with `prefix`) have their body sent to us.
    engine_priority: Annotated[bool | Literal["auto"], Meta(description="true, false or auto")] = "auto"
    # Read each stream's first event before its response headers go to the client, and answer an engine's
    # refusal inside a 200 (its own queue cap: vLLM's --max-num-queued-reqs/-tokens, SGLang's
    # --max-queued-requests, TGI's --max-concurrent-requests) with 503 engine_full, which the OpenAI SDKs
    # retry. It costs a message each way per streamed chunk (docs/engines.md). None: while an engine of the
    # model says it caps what it holds (SGLang's /server_info, TGI's /info); vLLM does not say.
    check_stream_start: bool | None = None
    # The most preemptions (of a preemptible band's requests, for a higher band whose
    # objective is at risk) per second; an idle-only band's lent slots are taken back
    # whatever the rate (core/preemption.py); 0: never preempt.
    max_preemptions_per_s: NonNegative = 2.0
    # The engine's batch size (vLLM --max-num-seqs), if known; else learned from its metrics.
    max_running: Count | None = None
    # The engine's context length (vLLM --max-model-len): the most tokens one
    # request can hold. The `vtc` cost estimate clamps a request's prompt and
    # output to it, so a client's `max_tokens: 1e308` costs what the largest
    # real request could, not infinity (docs/policies.md). None: what the engine
    # says (its max_model_len, adapters/engines/limits.py), 32,768 until it does.
    max_context_tokens: Count | None = None
    cost: CostSettings = msgspec.field(default_factory=CostSettings)
    # Prefix signatures of the requests' prompts (absent: none, unless policy is locality,
    # which gets the defaults: resolve.py fills it in).
    prefix: PrefixSettings | None = None
    # What only a developer tunes: the scrape's pace, the gate without metrics (advanced.py).
    advanced: ModelAdvanced = msgspec.field(default_factory=ModelAdvanced)

    REMOVED = {key: f"moved to {{path}}.advanced.{key}" for key in MODEL_ADVANCED}

    def waiting_kept(self) -> int:
        """``reserved_waiting``, resolved: as written, else all of the engine's queue room but one place."""
        return self.reserved_waiting if self.reserved_waiting is not None else max(0, self.target_waiting - 1)

    def cold_start_wait(self) -> float:
        """How long a request is kept while no engine of the pool is up: ``cold_start_wait_s``, else ``max_queue_wait_s``."""
        return self.max_queue_wait_s if self.cold_start_wait_s is None else self.cold_start_wait_s

    def may_check_stream_start(self) -> bool:
        """Whether this model's streams may have their first event read: set, or unset on an engine that says its
        queue cap (then while one of its engines says it caps what it holds)."""
        if self.check_stream_start is None:
            return DIALECTS[self.engine].says_cap
        return self.check_stream_start

    def cost_weights(self) -> CostWeights:
        """How the `vtc` policy prices this model's requests: the cost section, the context length, the cached price."""
        cached = self.prefix.cached_input_weight if self.prefix else CostWeights.cached_input_weight
        return replace(self.cost.weights(), max_context_tokens=self.max_context_tokens, cached_input_weight=cached)


class BandSettings(Section, frozen=True):
    """One band's entry as written, its fields named as :class:`~extproc.core.bands.Band`' (which documents them).

    An unset field takes the core's default, except where that depends on
    the band's place (resolve.py).
    """

    max_queue_wait_s: Positive | None = None
    max_queued: Count | None = None
    idle_only: bool | None = None
    idle_running_share: Share = Band.idle_running_share
    reserve_share: ReserveShare = Band.reserve_share
    engine_priority: int | None = None
    ttft_objective_s: Positive | None = None
    min_ttft_objective_s: Positive | None = None
    preemptible: bool | None = None
    min_share: ReleaseShare | None = None


class TenantSettings(Section, frozen=True):
    """A tenant's entry as written; unset fields are inherited from the `default` entry.

    Its fields are named as :class:`~extproc.core.entitlement.Tenant`'s, except
    the two the file names for priorities (``priorities``, ``default_priority``).
    """

    weight: Positive | None = None
    priorities: Names | None = None
    default_priority: NonEmpty | None = None
    max_queued: Count | None = None


class JwtSettings(Section, frozen=True):
    """Envoy's jwt_authn: a verified token's claim names the tenant."""

    issuer: NonEmpty
    audiences: tuple[NonEmpty, ...] = ()
    # Exactly one: a JWKS document inline (JSON text, or YAML), or the URL Envoy fetches it from.
    jwks: Jwks | None = None
    jwks_uri: HttpUrl | None = None
    tenant_claim: NonEmpty = "sub"


class EndpointPickerSettings(Section, frozen=True):
    """The Endpoint Picker Protocol's knobs, for requests attached by ext_proc alone (docs/epp.md)."""

    # A body read from the stream larger than this is refused 413.
    max_body_bytes: Count = 10 * 1024 * 1024
    # The status of a request shed under load (queue full, timed out, overloaded): the protocol's 429.
    shed_status: Literal[429, 503] = 429
    # Endpoints named after the pick, in order of preference, so a dead one costs a retry. Only
    # for a gateway whose pool cluster walks the list (Envoy's override_host policy): an
    # ORIGINAL_DST cluster (Envoy AI Gateway) takes one address and fails a list with 503.
    fallbacks: Count0 = 0


# The admission bucket's refill as a share of the processor's intake (EnvoySettings.admission).
ADMISSION_REFILL_SHARE = Fraction(2, 3)
# The processor's intake by transport: the requests of a burst it takes in per second within the message
# timeout. h2's is measured (3,000 in 2 s on a loaded 2-core machine, docs/reports/reliability.md, "Bursts");
# grpcio's is h2's scaled by what each transport releases at most (807 against 1,599 req/s,
# docs/reports/benchmarks.md, "The two transports"), not measured with bursts.
INTAKE_PER_S = {"builtin": 1500, "grpcio": 750}


@dataclass(frozen=True)
class AdmissionBucket:
    """Envoy's admission bucket as generated: its size and its refill per second."""

    tokens: int
    per_second: int


class EnvoySettings(Section, frozen=True):
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
    # intake (INTAKE_PER_S, by listen.transport). Unset, admission_per_second is 2/3 of it, since
    # requests that keep arriving while a burst is taken in add to it, and admission_burst is the
    # intake (admission_per_second x 3/2) x the timeout (3,000 at 2 s on h2), so a longer timeout
    # takes in a larger burst. Beyond that, Envoy answers 503 `overloaded` at once rather than
    # let streams outrun the message timeout (docs/guides/operate.md, "Sizing the admission bucket").
    admission_burst: Count | None = None
    admission_per_second: Count | None = None
    # Production-grade identity: a bearer JWT verified by Envoy (exclusive with api_keys).
    jwt: JwtSettings | None = None
    # With listen.tls: the CA Envoy checks the processor's certificate against (without it, any
    # certificate is accepted, as Gateway API Inference Extension gateways do), and the certificate
    # Envoy presents when listen.tls.client_ca_file asks for one. Paths as Envoy sees them.
    processor_ca_file: NonEmpty | None = None
    processor_client_cert_file: NonEmpty | None = None
    processor_client_key_file: NonEmpty | None = None

    def admission(self, transport: str) -> AdmissionBucket:
        """The bucket in front of a processor on ``transport``: each value as set, else from its intake."""
        per_second = self.admission_per_second
        if per_second is None:
            per_second = math.floor(INTAKE_PER_S[transport] * ADMISSION_REFILL_SHARE)
        tokens = self.admission_burst
        if tokens is None:  # what the processor takes in within the message timeout
            tokens = math.ceil(per_second / ADMISSION_REFILL_SHARE * self.message_timeout_ms / 1000)
        return AdmissionBucket(tokens, per_second)


class ConfigFile(Section, frozen=True):
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
    # What only a developer tunes (advanced.py).
    advanced: AdvancedSettings = msgspec.field(default_factory=AdvancedSettings)
    # Tenant budgets: rate limits, token and money budgets (adapters/config/budgets.py, docs/budgets.md).
    budgets: BudgetSettings | None = None
    # OpenAI's Batch API on idle capacity (config/batches.py, docs/batches.md).
    batches: BatchSettings | None = None
