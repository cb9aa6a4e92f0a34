"""The adapters: where the pure core meets Envoy, the engines, Prometheus and the config file.

* ``ext_proc/``     the ext_proc servicer Envoy calls for each request, and how Envoy attached it;
* ``request/``      a request as the edge knows it: its fields, admission, prefix signature, reported usage;
* ``grpc/``         the gRPC servers that carry it (``listen.transport``), TLS and gRPC health;
* ``transports.py`` those servers by ``listen.transport`` name, each imported only when chosen;
* ``engines/``      the scraper, the probe, pool membership (DNS);
* ``envoy/``        the Envoy bootstrap (or drop-in) generated from the config;
* ``protocol/``     the protocols spoken with the outside: the Envoy contract, the answers, dialects, the EPP;
* ``config/``       the typed YAML configuration: schema, rules, resolution, loading;
* ``wiring.py``     the config turned into each model's dispatcher;
* ``runtime.py``    one model's parts at the edge (``ModelRuntime``), updated or replaced on reload;
* ``telemetry/``    the processor's Prometheus series, each model's recorder, the decision and health lines;
* ``logs.py``       the process's log output, text or JSON (``extproc --log-format``);
* ``server.py``     ``extproc serve``: all of the above in one process.

They import the core and each other, never ``extproc.tools``, and their packages import each other one
way (tests/test_layers.py): the modules here compose the packages, which import none of them.
"""
