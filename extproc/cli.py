"""Command line entry point: ``extproc serve|sim|envoy-config|demo``."""
