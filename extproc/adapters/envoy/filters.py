"""The HTTP filter chain as an ordered registry: one row per filter.

A row names the filter, its builder (the ``typed_config``), when it is in the
chain, how the drop-in treats it and which of Envoy's own answers it gives
(each has its rewrite in ``local_replies.py``). The chain, the drop-in's
renamed and disabled copies and the checks in the tests all read the rows,
so adding a filter is one builder and one row.

The request path:

1. identity: ``header_mutation`` removes client-sent tenant and model headers
   (a client may neither pick its tenant nor route around the processor) and
   the processor's own headers; then ``api_key_auth`` (``envoy.api_keys``)
   or ``jwt_authn`` (``envoy.jwt``) sets the tenant header, 401 without a
   known key or valid token. With neither, no request has a tenant header.
2. ``json_to_metadata`` copies the body's ``model``, ``max_tokens``,
   ``max_completion_tokens`` and ``prompt_cache_key`` (with budgets or a
   model that checks its streams' start, also ``stream`` and
   ``stream_options.include_usage``) into dynamic metadata
   ``extproc``; it buffers the body first, so the metadata exists when
   ext_proc sends the request headers. Only JSON bodies are parsed; anything
   else names no model and the processor answers 400.
3. ``local_ratelimit`` sheds a burst the processor could not answer in time;
   ``ext_proc`` sends the headers (with that metadata) to the processor,
   which holds the request while it is queued (``override_message_timeout``)
   and, on release, sets the model header and clears the route cache.
   ``response_trailer_mode: SEND`` keeps the stream open until the response
   ends, so the processor sees completion without per-chunk messages (with
   Envoy 1.40, an upstream without trailers sends no trailers message: the
   stream just ends). On the releases it checks, the processor turns on
   ``response_header_mode`` (``mode_override``) to see the status: the
   router's own 503 for an unreachable engine marks the endpoint down
   (``ext_proc/attach/release_outcome.py``). ``failure_mode_allow``: an unreachable
   processor sets no model header, and the routes decide
   (``envoy.processor_failure``, routes.py); a released response keeps
   streaming if the processor dies meanwhile.
4. ``router`` (routes.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from extproc.adapters.config import Config
from extproc.adapters.envoy.base import Json, duration, hold_timeout_s, typed
from extproc.adapters.envoy.clusters import EXTPROC_CLUSTER, JWKS_CLUSTER
from extproc.adapters.protocol.contract import (
    BATCH_LINE_HEADER,
    DESTINATION_HEADER,
    INCLUDE_USAGE_FIELD,
    METADATA_NAMESPACE,
    MODEL_HEADER,
    PROCESSING_MODE,
    QUEUE_WAIT_HEADER,
    STREAM_FIELD,
)
from extproc.core.values.outcomes import Refusal

EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
JWT_PROVIDER = "tenant"
JWKS_FETCH_TIMEOUT_S = 5.0
JWKS_CACHE_S = 600.0
# Request headers the processor sets that Envoy copies onto the response, so
# clients see them (ext_proc only reads the response headers).
ECHOED_HEADERS = (QUEUE_WAIT_HEADER,)
# json_to_metadata compares the whole Content-Type: list the spellings SDKs send.
JSON_CONTENT_TYPES = ("application/json", "application/json; charset=utf-8", "application/json;charset=utf-8")
# The admission bucket's statistics: ``<prefix>.http_local_rate_limit.rate_limited`` counts what it shed.
ADMISSION_STAT_PREFIX = "extproc_admission"
# The filters that decide who asks (the client's headers removed, then a key or a token): the batch API's
# routes run them, and only them (envoy/batches.py).
IDENTITY_FILTERS = ("envoy.filters.http.header_mutation", "envoy.filters.http.api_key_auth",
                    "envoy.filters.http.jwt_authn")
# A drop-in's filters are named so, so a merge finds them again.
DROP_IN_FILTER_PREFIX = "extproc."


@dataclass(frozen=True)
class Chain:
    """What the chain is built for."""

    # False: the same gateway without the processor (the benchmark's Envoy-only baseline).
    ext_proc: bool = True
    # A drop-in into an operator's Envoy, whose own auth filter may set the tenant header.
    drop_in: bool = False
    # The batch runner's listener: no auth filter, the runner's tenant header kept (envoy/batches.py).
    runner: bool = False


class DropIn(Enum):
    """What the drop-in does with a filter."""

    OWN = "own"  # added as ``extproc.<name>``, disabled, turned on by the drop-in's routes
    THEIRS = "theirs"  # the operator's Envoy has it already (the router)


@dataclass(frozen=True)
class Filter:
    name: str
    build: Callable[[Config, Chain], Json]  # the filter's typed_config
    enabled: Callable[[Config, Chain], bool]
    drop_in: DropIn = DropIn.OWN
    # Envoy's own answers this filter gives (rewritten by local_replies.LOCAL_REPLIES).
    replies: tuple[Refusal, ...] = ()


def _always(config: Config, chain: Chain) -> bool:
    return True


def _with_processor(config: Config, chain: Chain) -> bool:
    return chain.ext_proc


def _own_identity(config: Config) -> bool:
    """Whether our own auth filter sets the tenant header."""
    return bool(config.envoy.api_keys) or config.envoy.jwt is not None


def _sanitise(config: Config, chain: Chain) -> Json:
    """Drop headers only Envoy and the processor may set.

    The model header routes the request: a client-sent one must not survive
    into the processor or the router. The tenant header (and the fairness-id
    headers, which name a tenant too) is stripped as well: api_key_auth or
    jwt_authn, when configured, set it afterwards. A drop-in without either
    leaves identity to the operator's own auth filter, which runs earlier and
    sets it. The batch-line header is the runner's (its listener keeps it).
    """
    identity = config.identity
    keep_tenant = chain.runner or (chain.drop_in and not _own_identity(config))
    tenant = [] if keep_tenant else [identity.tenant_header, *identity.fairness_id_headers]
    batch_line = [] if chain.runner else [BATCH_LINE_HEADER]  # only the batch runner names a batch line
    remove = [MODEL_HEADER, *tenant, DESTINATION_HEADER, *ECHOED_HEADERS, *batch_line]
    return typed("envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                 mutations={"request_mutations": [{"remove": name} for name in remove]})


def _api_key_auth(config: Config, chain: Chain) -> Json:
    return typed(
        "envoy.extensions.filters.http.api_key_auth.v3.ApiKeyAuth",
        credentials=[{"key": key, "client": client} for key, client in config.envoy.api_keys.items()],
        # The filter strips a leading "Bearer " from a header source; an
        # unknown or missing key is answered 401.
        key_sources=[{"header": "authorization"}],
        # The tenant header is set (replaced) with the key's client; the
        # tenant's key is not passed on to the model servers.
        forwarding={"header": config.identity.tenant_header, "hide_credentials": True},
    )


def _jwt_authn(config: Config, chain: Chain) -> Json:
    jwt = config.envoy.jwt
    assert jwt is not None
    provider: Json = {
        "issuer": jwt.issuer,
        # The token is not passed on to the model servers.
        "forward": False,
        # Written after header_mutation removed any client-sent tenant header.
        "claim_to_headers": [{"header_name": config.identity.tenant_header, "claim_name": jwt.tenant_claim}],
    }
    if jwt.audiences:
        provider["audiences"] = list(jwt.audiences)
    if jwt.jwks is not None:
        provider["local_jwks"] = {"inline_string": jwt.jwks}
    else:
        provider["remote_jwks"] = {
            "http_uri": {"uri": jwt.jwks_uri, "cluster": JWKS_CLUSTER, "timeout": duration(JWKS_FETCH_TIMEOUT_S)},
            "cache_duration": duration(JWKS_CACHE_S),
            # Fetched at start-up and refreshed in the background, not on a request's path.
            "async_fetch": {},
        }
    return typed(
        "envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
        providers={JWT_PROVIDER: provider},
        # Every request needs a valid token (Authorization: Bearer <jwt>); else 401.
        rules=[{"match": {"prefix": "/"}, "requires": {"provider_name": JWT_PROVIDER}}],
    )


def _json_to_metadata(config: Config, chain: Chain) -> Json:
    def rule(key: str, value_type: str, *path: str) -> Json:
        return {"selectors": [{"key": k} for k in (*path, key)],
                "on_present": {"metadata_namespace": METADATA_NAMESPACE, "key": key, "type": value_type}}

    # Whether the answer streams: a whole answer can be taken back until it completes (core/preemption.py), a
    # stream begins as the engine accepts it (and a model that checks its streams' first event needs to know a
    # stream). Budgets charge the engine's usage, which a stream carries at its end only if its client asked for
    # it: without budgets nothing reads that, and nothing is written.
    usage = [rule(INCLUDE_USAGE_FIELD, "PROTOBUF_VALUE", "stream_options")]

    return typed(
        "envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata",
        request_rules={
            "allow_content_types": list(JSON_CONTENT_TYPES),
            "rules": [
                rule("model", "STRING"),
                # As written (PROTOBUF_VALUE): NUMBER would turn "nan" and "inf"
                # into numbers and true into 1; the processor refuses those.
                rule("max_tokens", "PROTOBUF_VALUE"),
                rule("max_completion_tokens", "PROTOBUF_VALUE"),
                # Prefix-cache affinity for endpoint picking (OpenAI's field).
                rule("prompt_cache_key", "STRING"),
                rule(STREAM_FIELD, "PROTOBUF_VALUE"),
                *(usage if config.budgets is not None else ()),
            ],
        },
    )


def _admission(config: Config, chain: Chain) -> Json:
    """A token bucket in front of the processor: a burst it cannot answer in time is shed here.

    The processor takes in new streams at a bounded rate; Envoy starts every
    stream's message timeout at once, so the tail of a large enough burst would
    outrun it. The bucket holds what the processor takes in within that timeout
    (``EnvoySettings.admission``), so a burst it can hold reaches it
    whole. Envoy answers the excess itself, at once: 503 ``overloaded`` with
    Retry-After (the JSON error comes from local_replies.py, which knows the
    filter's reply by its details, ``local_rate_limited``). Held requests hold
    no token: the bucket limits arrivals, not the queue.
    """
    bucket = config.envoy.admission(config.listen.transport)

    def always(key: str) -> Json:
        return {"default_value": {"numerator": 100, "denominator": "HUNDRED"}, "runtime_key": key}

    return typed(
        "envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
        stat_prefix=ADMISSION_STAT_PREFIX,
        status={"code": "ServiceUnavailable"},
        token_bucket={"max_tokens": bucket.tokens, "tokens_per_fill": bucket.per_second,
                      "fill_interval": "1s"},
        filter_enabled=always(f"{ADMISSION_STAT_PREFIX}.enabled"),
        filter_enforced=always(f"{ADMISSION_STAT_PREFIX}.enforced"),
    )


def _ext_proc(config: Config, chain: Chain) -> Json:
    return typed(
        "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        grpc_service={"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}},
        # Always allowed: a released request whose processor dies must run on (its
        # stream only waits for the response's end). Whether a request the processor
        # never answered may reach the engine is decided by the routes: without the
        # model header it set, only processor_failure: open routes it (routes.py).
        failure_mode_allow=True,
        processing_mode=dict(PROCESSING_MODE),
        # Short, so a dead processor is noticed fast; the processor holds
        # a queued request with override_message_timeout up to the maximum.
        message_timeout=duration(config.envoy.message_timeout_ms / 1000),
        max_message_timeout=duration(hold_timeout_s(config)),
        allow_mode_override=True,
        metadata_options={"forwarding_namespaces": {"untyped": [METADATA_NAMESPACE]}},
    )


def _router(config: Config, chain: Chain) -> Json:
    return typed("envoy.extensions.filters.http.router.v3.Router")


# In chain order.
FILTERS = (
    Filter("envoy.filters.http.header_mutation", _sanitise, _always),
    Filter("envoy.filters.http.api_key_auth", _api_key_auth,
           lambda config, chain: bool(config.envoy.api_keys) and not chain.runner,
           replies=(Refusal.UNAUTHENTICATED,)),
    Filter("envoy.filters.http.jwt_authn", _jwt_authn,
           lambda config, chain: config.envoy.jwt is not None and not chain.runner,
           replies=(Refusal.UNAUTHENTICATED, Refusal.PERMISSION_DENIED)),
    Filter("envoy.filters.http.json_to_metadata", _json_to_metadata, _always, replies=(Refusal.REQUEST_TOO_LARGE,)),
    Filter("envoy.filters.http.local_ratelimit", _admission, _with_processor, replies=(Refusal.OVERLOADED,)),
    Filter(EXT_PROC_FILTER, _ext_proc, _with_processor),
    Filter("envoy.filters.http.router", _router, _always, DropIn.THEIRS,
           replies=(Refusal.ENGINE_UNAVAILABLE, Refusal.UPSTREAM_TIMEOUT, Refusal.OVERLOADED, Refusal.MODEL_NOT_FOUND)),
)


def drop_in_name(name: str) -> str:
    """``envoy.filters.http.ext_proc`` -> ``extproc.ext_proc``."""
    return DROP_IN_FILTER_PREFIX + name.rpartition(".")[2]


def http_filters(config: Config, chain: Chain = Chain()) -> list[Json]:
    """The HTTP filter chain, in order."""
    return [{"name": row.name, "typed_config": row.build(config, chain)} for row in FILTERS if row.enabled(config, chain)]


def drop_in_filters(config: Config) -> list[Json]:
    """The drop-in's own filters: renamed, and off except on the routes that turn them on."""
    chain = Chain(drop_in=True)
    return [{"name": drop_in_name(row.name), "typed_config": row.build(config, chain), "disabled": True}
            for row in FILTERS if row.drop_in is DropIn.OWN and row.enabled(config, chain)]
