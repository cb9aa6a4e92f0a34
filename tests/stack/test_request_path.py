"""One released request's path through the processor: each module entered at most three times, in order.

``python -m extproc.tools.request_path`` traces one request from a real Envoy
(our bootstrap, the builtin transport, the gate uncontended) from its ext_proc
stream's first bytes to its CONTINUE written. A module entered again and
again is a part asked piecemeal what one call with what it needs could answer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.tools.request_path import trace_request

pytestmark = pytest.mark.integration

BOUND = 3


async def test_a_released_request_enters_no_module_more_than_three_times(tmp_path: Path) -> None:
    path = await trace_request(tmp_path)
    # The whole path was traced: the transport's bytes in, the stream, the scheduler, the release written.
    assert {"extproc.adapters.grpc.builtin.connection", "extproc.adapters.ext_proc.servicer",
            "extproc.core.dispatcher", "extproc.core.model_state", "extproc.core.fair_queue",
            "extproc.core.release.pool"} <= set(path.entries), path.lines()
    assert path.modules[0] == "extproc.adapters.grpc.builtin.connection"
    over = {module: entries for module, entries in path.entries.items() if entries > BOUND}
    assert not over, "\n".join(path.lines(steps=True))
