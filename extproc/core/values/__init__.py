"""The values the core takes and gives, below both the core and its release side (``release/``).

* ``engine_load.py`` what one scrape said (``EngineLoad``) and what an engine says of its limits;
* ``outcomes.py``    every reason a request is answered instead of the engine, by name;
* ``report.py``      what a dispatcher reports: four kinds of event, one call;
* ``status.py``      what a dispatcher holds now, read on request (status page, ``/readyz``).

They import nothing else of the core, so the model's state (``core/``) and the
pool (``core/release/``) both read them without importing each other's modules
upwards: the package graph stays acyclic (tests/test_layers.py).
"""
