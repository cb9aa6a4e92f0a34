"""Development tools around the gateway, not needed to serve it.

* ``cli.py``      their command, ``extproc-dev`` (``python -m extproc.tools``);
* ``sim/``        a vLLM stand-in (``extproc-dev sim``);
* ``bench/``      the benchmark (``extproc-dev bench``);
* ``demo.py``     the power-user demo (``extproc-dev demo``);
* ``power_user.py`` the demo's scenario and the chat client the tests and the benchmark share;
* ``stack.py``    the local deployment as child processes: simulators, ``extproc serve``, Envoy
  (``procs.py`` runs children, ``envoy_proc.py`` runs Envoy, ``envoy_bin.py`` finds its binary);
* ``realvllm.py`` a real vLLM (the CPU build, in a virtualenv of its own) on a small model that
  ``realvllm_model.py`` builds: the engine of ``tests/stack/test_real_vllm.py`` and the benchmark.

Tools may import the adapters, the core and the ``extproc`` command's conventions
(``extproc/cli.py``); nothing outside ``tools/`` imports them (tests/test_layers.py).
"""
