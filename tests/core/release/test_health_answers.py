"""The endpoint health's kept answers are the answers: ``serving()`` and ``degraded(now)`` as if asked afresh.

``EndpointHealth`` keeps its last answers while nothing that changes them
happened (``health.py``): these tests drive it through scrapes good, failed
and refused, responses, probes' marks and membership changes, asked at times
that go back and forth, and compare each answer with its definition.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from extproc.core.release.health import EndpointHealth
from extproc.core.values.engine_load import EngineLoad
from tests.propertyutil import examples

pytestmark = pytest.mark.unit

ENDPOINTS = ("e1", "e2", "e3")
times = st.sampled_from([0.0, 0.5, 0.99, 1.0, 1.01, 1.5, 2.0, 3.0, 10.0])
steps = st.lists(st.one_of(
    st.tuples(st.just("scrape"), st.sampled_from(ENDPOINTS), times, st.sampled_from([None, 0, 3])),
    st.tuples(st.just("refused"), st.sampled_from(ENDPOINTS), times),
    st.tuples(st.just("response"), st.sampled_from(ENDPOINTS), times, st.booleans()),
    st.tuples(st.just("down"), st.sampled_from(ENDPOINTS), times),
    st.tuples(st.just("members"), st.lists(st.sampled_from(ENDPOINTS), min_size=1, max_size=3, unique=True)),
    st.tuples(st.just("ask"), times),
), max_size=40)


@settings(max_examples=examples(300), deadline=None)
@example(script=[("scrape", "e1", 0.0, 3), ("ask", 2.0), ("ask", 0.5)])  # stale when asked late, fresh when asked early
@example(script=[("scrape", "e1", 1.0, 3), ("ask", 1.5), ("ask", 2.5)])  # fresh, then stale
@given(script=steps)
def test_serving_and_degraded_answer_as_their_definitions_whenever_asked(script: list[tuple[Any, ...]]) -> None:
    health = EndpointHealth(ENDPOINTS, stale_after_s=1.0, fallback_max_in_flight=4)
    for step in script:
        if step[0] == "scrape":
            load = None if step[3] is None else EngineLoad(waiting=0, running=step[3])
            health.record_scrape(step[1], load, step[2])
        elif step[0] == "refused":
            health.record_scrape(step[1], None, step[2], reachable=False)
        elif step[0] == "response":
            health.record_response(step[1], step[3], step[2])
        elif step[0] == "down":
            health.mark_down(step[1], step[2])
        elif step[0] == "members":
            health.set_endpoints(step[1])
        else:
            now = step[1]
            assert health.serving() == tuple(e for e in health.endpoints if not health.is_down(e))
            assert health.degraded(now) == tuple(e for e in health.endpoints if not health.healthy(e, now))
