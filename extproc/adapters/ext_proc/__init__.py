"""Envoy's side of a request: the ext_proc servicer and how Envoy attached it (``attach/``). What it agrees on
with the generated config is ``adapters/protocol/``'s, the request's values ``adapters/request/``'s, and the gRPC
server that carries its streams ``adapters/grpc/``'s."""
