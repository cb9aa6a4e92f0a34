"""The gRPC servers by ``listen.transport`` name, each imported only once it is looked up.

A processor runs one of them, so it loads only that one: grpcio (grpc.aio and
its C-core) is not imported where ``builtin`` serves, as httpx loads its
optional extras only when a client asks for them. Listing the names imports
nothing; ``TRANSPORTS[name]`` imports that server's module and returns its
class, a :data:`~extproc.adapters.grpc.transport.TransportFactory` (mypy checks
each against :class:`~extproc.adapters.grpc.transport.Transport` here).
tests/adapters/grpc/test_transport_differential.py, the conformance suite, runs every case
against each entry; config/schema.py ``TRANSPORT_NAMES`` names the same ones.
It sits above ``grpc/`` and ``grpc/builtin/``, which import the seam from
``grpc/`` and never this registry, so the packages import each other one way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from extproc.adapters.grpc.transport import TransportFactory


def _builtin() -> TransportFactory:
    """Ours (builtin/): a few KB per held request."""
    from extproc.adapters.grpc.builtin.server import BuiltinServer

    return BuiltinServer


def _grpcio() -> TransportFactory:
    """grpc.aio, the reference (docs/decisions.md, "When to choose grpcio")."""
    from extproc.adapters.grpc.grpcio_server import GrpcioServer

    return GrpcioServer


class Transports(Mapping[str, TransportFactory]):
    """A registry whose entries are imported when looked up, not when listed."""

    def __init__(self, loaders: Mapping[str, Callable[[], TransportFactory]]) -> None:
        self._loaders = dict(loaders)

    def __getitem__(self, name: str) -> TransportFactory:
        return self._loaders[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)


TRANSPORTS: Mapping[str, TransportFactory] = Transports({"builtin": _builtin, "grpcio": _grpcio})
