"""How the engine answered a released request, as far as the gate cares.

Three answers, because they call for three different reactions:

* ``SERVED``: the engine took the request (whatever its status: a 400 for a
  bad body, a 500 on one request, still a live engine);
* ``FULL``: the engine refused it before starting it, because its own queue
  cap was reached (vLLM's ``--max-num-queued-reqs``, TGI's
  ``--max-concurrent-requests``). That is backpressure: the endpoint's limit
  is cut, and it stays up;
* ``DOWN``: no answer from the engine at all (connection refused, reset
  before a response): nothing more goes to it until it shows life.

The adapters read it from what they see of the response
(``adapters/ext_proc/attach/release_outcome.py``); the core acts on it.
"""

from __future__ import annotations

from enum import StrEnum


class Answer(StrEnum):
    SERVED = "served"
    FULL = "full"
    DOWN = "down"
