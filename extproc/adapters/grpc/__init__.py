"""The gRPC servers that carry the ext_proc streams (``listen.transport``), and what both serve beside them.

* ``transport.py``     the seam: what a server owes (``Transport``), the methods table, ``GrpcError``, ``TransportLimits``;
* ``builtin/``         ours (``listen.transport: builtin``): a gRPC server on its own HTTP/2 layer;
* ``grpcio_server.py`` that seam on grpc.aio (``listen.transport: grpcio``), the reference;
* ``tls.py``           TLS on the port (``listen.tls``), its files reloaded while serving;
* ``health.py``        ``grpc.health.v1`` Check: liveness and readiness, on either server;
* ``peer_warnings.py`` warnings about peers, rate-limited per peer host (both servers' pace).

The registry of servers by name is ``adapters/transports.py``, above this package and ``builtin/``.

What they carry (the ext_proc servicer) is ``adapters/ext_proc/``'s: a server knows it only as a table of methods.
"""
