"""Envoy's side of a request: the ext_proc servicer, how Envoy attached it (``attach/``), its gRPC transport,
and the contract with the generated config."""
