"""matplotlib for the tools' plots (the benchmark's report, the soak's), imported on the first plot.

Shared from here rather than from the benchmark so that the soak, a command
of its own, imports nothing of ``bench/`` (tests/test_layers.py: the package
graph is acyclic).
"""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType:
    """matplotlib's pyplot, drawing to files only: imported on the first plot, not with the module.

    It takes 0.4 s of CPU to import; the report's tables and every command
    that only reads results need none of it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
