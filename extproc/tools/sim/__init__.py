"""A vLLM stand-in: realistic continuous batching, vLLM's HTTP API and metric names.

Used by tests, the demo and benchmarks in place of a GPU inference server.
"""

from extproc.tools.sim.engine import SimSettings
from extproc.tools.sim.server import RunningSim, add_arguments, run, start_sim

__all__ = ["RunningSim", "SimSettings", "add_arguments", "run", "start_sim"]
