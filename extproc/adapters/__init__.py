"""The adapters: where the pure core meets Envoy, the engines, Prometheus and the config file.

* ``ext_proc/``     the ext_proc servicer Envoy calls for each request, and what
  it and the generated Envoy config agree on;
* ``grpc/``         the gRPC servers that carry it (``listen.transport``), TLS and gRPC health;
* ``engines/``      each engine's ``/metrics`` dialect, the scraper, pool
  membership (DNS);
* ``envoy/``        the Envoy bootstrap (or drop-in) generated from the config;
* ``answers.py``    what a client hears for each reason: status, error type, Retry-After;
* ``config/``       the typed YAML configuration: schema, rules, resolution, loading;
* ``wiring.py``     the config turned into each model's dispatcher;
* ``telemetry/``    the processor's Prometheus series and each model's recorder;
* ``server.py``     ``extproc serve``: all of the above in one process.

They import the core and each other, never ``extproc.tools`` (tests/test_layers.py).
"""
