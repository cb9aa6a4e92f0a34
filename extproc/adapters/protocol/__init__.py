"""The protocols the adapters speak with the outside, as the outside defines them: facts every adapter reads.

* ``contract.py``     what the generated Envoy config and the processor agree on: headers, processing mode, hold;
* ``answers.py``      what a client hears for each refusal: status, OpenAI error type, Retry-After, the body;
* ``dialects.py``     each engine's ``/metrics`` names (read into ``EngineLoad``) and how it refuses;
* ``epp_protocol.py`` the Endpoint Picker Protocol's names and messages.

It imports no other adapter, so the config (which checks names against these
tables), the Envoy config generator, the servicer and the scrapers all read
them without importing each other (tests/test_layers.py: the package graph
is acyclic).
"""
