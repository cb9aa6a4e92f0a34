"""Envoy's side of a request: the ext_proc servicer, the body rewrite, and the contract with the generated config."""
