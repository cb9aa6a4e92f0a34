"""Envoy's side of a request: the ext_proc servicer, how Envoy attached it (``attach/``), and the contract with the
generated config. The gRPC server that carries its streams is ``adapters/grpc/``'s."""
