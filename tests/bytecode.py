"""The suite caches bytecode even where ``PYTHONDONTWRITEBYTECODE`` is set (as container images often set it).

Without the cache every pytest process (each xdist worker, and the
controller) rewrites the asserts of every test module again, and of every
module of the plugins that pytest rewrites too (hypothesis' 73 among them),
and every processor, simulator or CLI the tests start compiles the package
from source: about 7 s of CPU per worker before the first test runs. The
cached files are pytest's and Python's own ``__pycache__`` entries, keyed to
each source file's size and time, so a changed file is compiled again.

Loaded first with ``-p tests.bytecode`` (``addopts`` in pyproject.toml): pytest
rewrites a module as it imports it, and the plugins' modules are imported
after this one. The environment of the processes the tests start loses the
variable too.
"""

from __future__ import annotations

import os
import sys

sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
