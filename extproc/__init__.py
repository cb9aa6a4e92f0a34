"""Fair scheduling for self-hosted LLMs, as an Envoy ext_proc plugin."""

__version__ = "0.1.0"
