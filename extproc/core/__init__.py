"""The scheduling core: pure, no I/O, time passed in; it imports nothing from the adapters or the tools.

* ``dispatcher.py`` the per-model loop: a request enters, waits, is released, ends;
* ``model_state.py``, ``held.py`` the one owner of a model's state, and one held request's record;
* ``caps.py``, ``fair_queue.py``, ``policies/`` whether it may enter, and who goes next;
* ``bands.py``, ``release/`` how many may go now: the band rules above the model's release rule;
* ``cost.py``, ``pricing.py``, ``drain_time.py`` what a release costs (vtc, with the engines' caches),
  when a refused client may retry;
* ``values/`` the values it takes and gives (named refusals, what it reports, what a scrape said,
  its status), below both the core and ``release/``.

docs/architecture.md has the map and one request's path through it.
"""
