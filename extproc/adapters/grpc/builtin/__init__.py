"""``listen.transport: builtin``: our own gRPC server on our own HTTP/2 layer, built into the package.

Not the ``h2`` library (whose name the value had while it ran on it): a few
KB per held stream against grpc.aio's 21–24 KB (``server.py`` says why). From
the top down:

* ``server.py``        ``BuiltinServer``, the :class:`~extproc.adapters.grpc.transport.Transport`: listen, count calls, stop;
* ``connection.py``    one connection: streams to calls, a peer's bad bytes ending only their stream, GOAWAY;
* ``bounds.py``        what a connection may cost: reading paused while the peer does not read, ended past a limit;
* ``call.py``          one call: message framing, the inbox its handler reads, the statuses grpcio would send;
* ``http2.py``         the server side of HTTP/2 (RFC 9113): frames to events, flow control, protocol errors;
* ``streams.py``       its streams: an open one's record, a closed one's memory;
* ``flood.py``         frames that oblige an answer or carry nothing, counted and limited as Envoy's codec does;
* ``frames.py``        HTTP/2 frames as bytes;
* ``hpack_decoder.py`` HPACK decoding, a repeated header block decoded once while the table is unchanged.

It imports the seam (``grpc/transport.py``), TLS and the peer warnings from the package above, which imports
nothing of it: the registry that picks a server is ``adapters/transports.py``.
"""
