"""Envoy's configuration generated from the extproc Config: a bootstrap, a drop-in, a merge.

The pieces (one concept each): ``filters.py`` the HTTP filter registry,
``routes.py``, ``clusters.py``, ``local_replies.py`` (Envoy's own answers as
the processor's JSON errors), ``documents.py`` (the bootstrap and the
drop-in), ``merge.py`` (a drop-in into an operator's bootstrap, and the
protobuf check). Nothing here touches the network or the file system.
"""

from extproc.adapters.envoy.base import hold_timeout_s
from extproc.adapters.envoy.documents import DROP_IN_HEADER, HEADER, INTO_HEADER, LLM_PREFIXES, bootstrap, drop_in, render
from extproc.adapters.envoy.merge import bootstrap_message, merge, merge_checked

__all__ = ["DROP_IN_HEADER", "HEADER", "INTO_HEADER", "LLM_PREFIXES", "bootstrap", "bootstrap_message", "drop_in",
           "hold_timeout_s", "merge", "merge_checked", "render"]
