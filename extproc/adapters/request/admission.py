"""Who asks, for which model, how urgently: a request's admission, the same however Envoy attached the processor.

The tenant comes from the tenant header, which only Envoy's auth filter can
set (else the first fairness-id header present; missing: the default tenant,
or 401 with ``identity.missing_tenant: reject``). The class comes from the
priority header, else the objective header mapped through
``identity.objectives``, else the body's ``priority`` (a class name, or the
integer a band writes as its ``engine_priority``), limited by the tenant's
entitlement (``core/entitlement.py``): a class it may not use is downgraded
to the next lower one it may, never upgraded; with no lower one the request
is refused (403). The model is the body's, by its own name, a served name
or a pattern (:class:`ModelNames`).
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.adapters.config import Config, Identity, ModelConfig
from extproc.adapters.protocol.contract import BATCH_LINE_HEADER
from extproc.adapters.request.request_fields import RequestFields
from extproc.core.entitlement import grant
from extproc.core.values.outcomes import Refusal, Refused

# The longest batch-line tag kept (a batch id and a line number are far shorter): a log line stays a line.
MAX_BATCH_LINE = 128


@dataclass(frozen=True, slots=True)
class Admission:
    model: str
    tenant: str
    band: int
    # The band the request asked for, when it was downgraded.
    requested: int | None = None
    # The model name the body asked for, as counted (a served name or the pattern it matched).
    name: str = ""
    ttft_objective_s: float | None = None
    # The client says it is a retry (identity.retry_headers): never preempted.
    retried: bool = False
    # A batch line's "<batch>/<line>" (x-extproc-batch-line, set by the batch runner): its decision entries say so.
    batch_line: str = ""


def is_pattern(name: str) -> bool:
    """Whether a served name is a shell-style pattern rather than one name."""
    return any(c in name for c in "*?[")


class ModelNames:
    """Which configured model serves a requested name: its own name, a served name, or a pattern.

    Exact names first, then the patterns in the order the config lists them.
    Returns the model and the name to count it under (bounded by the config:
    a client-chosen name never becomes a label value itself).
    """

    def __init__(self, models: tuple[ModelConfig, ...]) -> None:
        names = [(n, m.name) for m in models for n in (m.name, *m.served_names)]
        self._exact = {n: model for n, model in names if not is_pattern(n)}
        self._patterns = [(n, model) for n, model in names if is_pattern(n)]

    def resolve(self, name: str) -> tuple[str, str] | None:
        """(model, counted name) for the requested ``name``; None if no model serves it."""
        model = self._exact.get(name)
        if model is not None:
            return model, name
        return next(((m, pattern) for pattern, m in self._patterns if fnmatch.fnmatchcase(name, pattern)), None)

    def listed(self) -> list[str]:
        """The names a client can ask for by name (``GET /v1/models``)."""
        return list(self._exact)


def _first(headers: Mapping[str, str], names: tuple[str, ...]) -> str:
    """The value of the first of ``names`` present (empty: none is)."""
    for name in names:  # a loop, not next() over a generator: three lookups per request
        value = headers.get(name)
        if value:
            return value
    return ""


def identified_tenant(headers: Mapping[str, str], identity: Identity) -> str:
    """The tenant Envoy's auth named (else a fairness id; none: the default tenant, or Refused with ``reject``).

    The batch API (``adapters/batches``) reads its callers the same way.
    """
    tenant = headers.get(identity.tenant_header) or _first(headers, identity.fairness_id_headers)
    if tenant:
        return tenant
    if identity.missing_tenant == "reject":
        raise Refused(Refusal.TENANT_MISSING, "the request carries no tenant identity; authenticate first")
    return identity.default_tenant


class Admissions:
    """A configuration's admission: :meth:`admit` turns a request's headers and body fields into an :class:`Admission`."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self.names = ModelNames(config.models)

    def admit(self, headers: dict[str, str], fields: RequestFields) -> Admission:
        """Who asks, for which model, how urgently — or why not (raises Refused)."""
        identity = self._config.identity
        if fields.model is None:
            raise Refused(
                Refusal.MODEL_MISSING,
                "the request body must be JSON (content-type: application/json) with a 'model' field",
            )
        resolved = self.names.resolve(fields.model)
        if resolved is None:
            known = ", ".join(sorted(self.names.listed()))
            raise Refused(Refusal.MODEL_NOT_FOUND, f"the model {fields.model!r} does not exist; served models: {known}")
        model, name = resolved
        tenant = identified_tenant(headers, identity)
        # The band: what it asks for, limited by the tenant's entitlement (core/entitlement.py decides).
        granted = grant(self._config.band_names, self._config.tenant(tenant), tenant, self._asked(headers, fields))
        retried = _first(headers, identity.retry_headers).strip() not in ("", "0")
        return Admission(model, tenant, granted.band, granted.requested, name, self._ttft_objective_s(headers), retried,
                         headers.get(BATCH_LINE_HEADER, "")[:MAX_BATCH_LINE])

    def _asked(self, headers: dict[str, str], fields: RequestFields) -> str:
        """The class the request asks for: the priority header, else its objective, else the body's priority."""
        identity = self._config.identity
        asked = headers.get(identity.priority_header, "").strip().lower()
        if asked:
            return asked
        objective = _first(headers, identity.objective_headers).strip()
        if objective:
            return identity.objectives.get(objective, "")
        priority = fields.priority
        if isinstance(priority, str):
            return priority.strip().lower()
        if isinstance(priority, int) and not isinstance(priority, bool):  # the engine's number for a class
            return next((b.name for b in self._config.bands if b.engine_priority == priority), "")
        return ""

    def _ttft_objective_s(self, headers: dict[str, str]) -> float | None:
        names = self._config.identity.ttft_headers
        written = _first(headers, names).strip()
        if not written:
            return None
        try:
            ms = float(written)
        except ValueError:
            ms = math.nan
        if not (math.isfinite(ms) and ms > 0):
            header = next(n for n in names if headers.get(n))
            raise Refused(Refusal.INVALID_TTFT_OBJECTIVE, f"{header} must be a number of milliseconds > 0, "
                          f"got {json.dumps(written[:40])}", param=header)
        return ms / 1000
