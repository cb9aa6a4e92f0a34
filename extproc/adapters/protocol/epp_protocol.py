"""The Endpoint Picker Protocol v1.0.0's names and messages (Gateway API Inference Extension).

Source: kubernetes-sigs/gateway-api-inference-extension,
docs/proposals/004-endpoint-picker-protocol/README.md at commit
84436a96b9e6ce2b59ddacd3d04c31b4fbd442de. A gateway that attaches an Endpoint
Picker (Envoy AI Gateway, Envoy Gateway, kgateway, Istio, GKE) generates an
ext_proc filter and nothing else: what it tells the picker and what it reads
back travel in dynamic metadata and one header, named here.

* In: the subset hint (``envoy.lb.subset_hint`` /
  ``x-gateway-destination-endpoint-subset``: the picker must pick inside it),
  and on the response the endpoint that served (``envoy.lb`` /
  ``x-gateway-destination-endpoint-served``; Envoy's own ``upstream.address``
  attribute is read where a gateway reports it that way instead).
* Out: the picked endpoint and its fallbacks, ``ip:port,ip:port``, both in the
  ``x-gateway-destination-endpoint`` header and in ``envoy.lb`` metadata, the
  same value in both.

How the body goes back in each body mode is the mode's, not the protocol's
(``attach/body.py``).
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.adapters.protocol.contract import DESTINATION_HEADER

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
DESTINATION_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
# Envoy's request attribute for the upstream host (ext_proc response_attributes).
SERVED_ATTRIBUTE = "upstream.address"


@functools.lru_cache(maxsize=4096)  # asked per release and per response, of a few pool members
def host_port(endpoint: str) -> str | None:
    """``http://10.0.0.7:8000`` -> ``10.0.0.7:8000``; None for a host name (the protocol names addresses)."""
    parts = urlsplit(endpoint)
    try:
        address = ipaddress.ip_address(parts.hostname or "")
    except ValueError:
        return None
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"{host}:{parts.port}"


def subset_hint(request: pb.ProcessingRequest) -> frozenset[str] | None:
    """The ``ip:port`` endpoints the gateway allows for this request; None when it sent no hint.

    The protocol's value is a list; a comma-separated string is read the same
    way, since header_to_metadata-style filters can only write strings.
    """
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items: Iterable[str] = (v.string_value for v in value.list_value.values)
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = ()
    return frozenset(item.strip() for item in items if item.strip())


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    """The ``ip:port`` that served the response, as the gateway reports it; None if it does not."""
    namespace = request.metadata_context.filter_metadata.get(DESTINATION_NAMESPACE)
    if namespace is not None and SERVED_KEY in namespace.fields:
        return namespace.fields[SERVED_KEY].string_value or None
    for attributes in request.attributes.values():
        if SERVED_ATTRIBUTE in attributes.fields:
            return attributes.fields[SERVED_ATTRIBUTE].string_value or None
    return None


def destination_metadata(value: str) -> struct_pb2.Struct:
    """``envoy.lb: {x-gateway-destination-endpoint: value}``, the header's value in metadata."""
    metadata = struct_pb2.Struct()
    metadata.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = value
    return metadata
