"""Preemption through real parts: Envoy, the processor, a simulator, the OpenAI SDK as the client.

Batch requests fill the engine's slots; an interactive chat with a tight
objective arrives. With preemption the youngest batch request is ended with a
JSON 503 ``preempted`` (the engine aborts it: its running count drops) and the
chat starts at once; the SDK's own retry brings the batch request back, and
it is not preempted twice. Assertions compare runs, never absolute times.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.tools.stack import start_stack
from tests.helpers.preemption import SIM, batch_client, config, flood_then_chat

pytestmark = pytest.mark.integration


async def test_a_chat_at_risk_preempts_the_youngest_batch_request_which_the_engine_aborts(tmp_path: Path) -> None:
    async with await start_stack(config(tmp_path), tmp_path, sim_args=SIM) as stack:
        results, ttft, running = await flood_then_chat(stack, batch_client(stack, retries=0))
    assert sorted(o for o, _ in results) == ["503:preempted", "ok"], results
    # The engine aborted the preempted request: only the other batch request ran after the chat.
    assert running == 1
    full = next(t for o, t in results if o == "ok")
    # The chat did not wait for a batch request to finish.
    assert ttft < full / 3, (ttft, full)


async def test_the_sdk_retries_a_preempted_request_and_a_retry_is_not_preempted(tmp_path: Path) -> None:
    async with await start_stack(config(tmp_path), tmp_path, sim_args=SIM) as stack:
        results, _, _ = await flood_then_chat(stack, batch_client(stack, retries=2))
        assert [o for o, _ in results] == ["ok", "ok"], results
        # Requests that say they are retries are not preempted: the chat waits for a slot.
        retried, waited, _ = await flood_then_chat(stack, batch_client(stack, retries=0),
                                                   **{"x-stainless-retry-count": "1"})
        assert [o for o, _ in retried] == ["ok", "ok"], retried
        assert waited > min(t for _, t in retried) / 3, (waited, retried)


async def test_without_preemption_the_chat_waits_for_a_slot(tmp_path: Path) -> None:
    async with await start_stack(config(tmp_path, max_preemptions_per_s=0), tmp_path, sim_args=SIM) as stack:
        results, ttft, _ = await flood_then_chat(stack, batch_client(stack, retries=0))
    assert [o for o, _ in results] == ["ok", "ok"], results
    assert ttft > min(t for _, t in results) / 3, (ttft, results)
