"""gRPC health (grpc.health.v1 ``Check``) on either transport: what Envoy and Kubernetes probes ask.

Like grpcio's ``HealthServicer``: a status per service name, an unknown name
is NOT_FOUND. The services are those of the Endpoint Picker Protocol
(docs/proposals/004-endpoint-picker-protocol in gateway-api-inference-extension):

* ``liveness``: SERVING while the process answers gRPC at all, through the drain
  too (restarting a draining processor would cut what it still serves);
* ``readiness``: SERVING once every model's pool is discovered (its first
  lookup done; an empty pool too: its requests are held for the cold start)
  and until the drain begins;
* ``envoy.service.ext_proc.v3.ExternalProcessor`` and ``""`` (the server as a
  whole, which grpcio's probes ask): the same as readiness.

``Watch`` is not served (UNIMPLEMENTED): Envoy and Kubernetes probes call ``Check``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from grpc_health.v1 import health_pb2

from extproc.adapters.grpc.transport import NOT_FOUND, GrpcError, Method, Methods
from extproc.adapters.protocol.contract import EXT_PROC_SERVICE

CHECK_PATH = "/grpc.health.v1.Health/Check"
LIVENESS, READINESS = "liveness", "readiness"
SERVING: int = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING: int = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """The statuses, read when asked: readiness is a question about the pools, not a stored flag."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self._ready = ready
        self._started = False
        self._shutting_down = False

    def start(self) -> None:
        """The processor serves: from now on readiness follows ``ready``."""
        self._started = True

    def enter_graceful_shutdown(self) -> None:
        """Not ready for good (liveness stays SERVING until the process exits)."""
        self._shutting_down = True

    def status(self, service: str) -> int | None:
        """The service's status; None for a service this server does not have."""
        if service == LIVENESS:
            return SERVING
        if service in (READINESS, EXT_PROC_SERVICE, ""):
            return SERVING if self._started and not self._shutting_down and self._ready() else NOT_SERVING
        return None

    async def check(self, requests: AsyncIterator[health_pb2.HealthCheckRequest]
                    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        async for request in requests:
            status = self.status(request.service)
            if status is None:
                raise GrpcError(NOT_FOUND, f"unknown service {request.service!r}")
            yield health_pb2.HealthCheckResponse(status=status)
            return

    def methods(self) -> Methods:
        return {CHECK_PATH: Method(health_pb2.HealthCheckRequest.FromString, self.check)}
