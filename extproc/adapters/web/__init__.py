"""The metrics port's HTTP server: ``/metrics``, ``/healthz``, ``/readyz``, the status page and its JSON."""
