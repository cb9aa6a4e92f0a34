"""gRPC health (grpc.health.v1 ``Check``) on the h2grpc transport: Envoy's health check asks it.

Like grpcio's ``HealthServicer``: a status per service name, an unknown name
is NOT_FOUND, and once the drain begins every service is NOT_SERVING for good.
``Watch`` is not served (UNIMPLEMENTED): Envoy and Kubernetes probes call ``Check``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from grpc_health.v1 import health_pb2

from extproc.adapters.ext_proc.h2grpc import NOT_FOUND, GrpcError, Method

CHECK_PATH = "/grpc.health.v1.Health/Check"


class Health:
    def __init__(self) -> None:
        self._status: dict[str, int] = {}
        self._shutting_down = False

    def set(self, service: str, status: int) -> None:
        if not self._shutting_down:
            self._status[service] = status

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, and later ``set`` calls are ignored."""
        self._shutting_down = True
        for service in self._status:
            self._status[service] = health_pb2.HealthCheckResponse.NOT_SERVING

    async def check(self, requests: AsyncIterator[health_pb2.HealthCheckRequest]
                    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        async for request in requests:
            status = self._status.get(request.service)
            if status is None:
                raise GrpcError(NOT_FOUND, f"unknown service {request.service!r}")
            yield health_pb2.HealthCheckResponse(status=status)
            return

    def methods(self) -> dict[str, Method]:
        return {CHECK_PATH: Method(health_pb2.HealthCheckRequest.FromString, self.check)}
