"""The ext_proc stream handler driven directly: admission and every way a hold can end."""

from __future__ import annotations

import asyncio
import json

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.config import parse_config
from extproc.adapters.envoy import hold_timeout_s
from extproc.adapters.ext_proc.servicer import Processor
from extproc.adapters.protocol.answers import ANSWERS
from extproc.adapters.protocol.contract import HOLD_MARGIN_S
from extproc.adapters.request.request_fields import RequestFields
from extproc.adapters.runtime import build_runtimes
from extproc.adapters.telemetry import Telemetry
from extproc.core.values.outcomes import Refusal, Refused
from tests.helpers.processor import CONFIG, Stream, headers_message, make_processor, settle

pytestmark = pytest.mark.unit


async def test_release_then_client_gone_before_continue_frees_the_slot() -> None:
    processor, dispatcher = make_processor()
    first = Stream(processor, headers_message())
    assert (await first.answers.get()).HasField("request_headers")  # released at once (fallback limit 1)
    second = Stream(processor, headers_message())
    assert (await second.answers.get()).HasField("override_message_timeout")  # held
    assert dispatcher.queued == 1
    first.close()
    # The first response finishes; the second is released — and its client leaves
    # in the same instant, as the stream is about to send CONTINUE.
    for _ in range(20):
        if not dispatcher.queued:
            break
        await asyncio.sleep(0)
    assert dispatcher.in_flight == 1 and dispatcher.queued == 0
    second.task.cancel()
    await settle()
    assert dispatcher.in_flight == 0
    assert dispatcher.queued == 0


async def test_queued_client_gone_leaves_the_queue() -> None:
    processor, dispatcher = make_processor()
    first = Stream(processor, headers_message())
    await first.answers.get()
    waiting = [Stream(processor, headers_message(tenant=f"t{i}")) for i in range(3)]
    for stream in waiting:
        await stream.answers.get()
    assert dispatcher.queued == 3
    waiting[1].task.cancel()
    await settle()
    assert dispatcher.queued == 2
    first.close()
    await settle()
    # The next in line (t0) is released; t1 is never released to a dead stream.
    assert (await waiting[0].answers.get()).HasField("request_headers")
    assert waiting[2].answers.empty() and dispatcher.queued == 1


async def test_draining_answers_the_queue_and_newcomers_once_each_and_counts_them() -> None:
    """The drain deadline (reject_all) and arrivals while draining: 503 shutting_down, each counted once."""
    telemetry = Telemetry()
    processor, dispatcher = make_processor(telemetry)
    running = Stream(processor, headers_message())
    assert (await running.answers.get()).HasField("request_headers")
    queued = [Stream(processor, headers_message(tenant=f"t{i}")) for i in range(2)]
    for stream in queued:
        assert (await stream.answers.get()).HasField("override_message_timeout")
    processor.draining = True
    newcomer = Stream(processor, headers_message(tenant="late"))
    dispatcher.reject_all()
    await settle()
    for stream in [*queued, newcomer]:
        answer = (await stream.answers.get()).immediate_response
        assert answer.status.code == 503 and json.loads(answer.body)["error"]["code"] == "shutting_down"
        assert stream.answers.empty()
    # The running response is untouched: it ends when its stream does.
    assert running.answers.empty() and dispatcher.in_flight == 1 and dispatcher.queued == 0
    rejected = {s.labels["tenant"]: s.value for m in telemetry.registry.collect() for s in m.samples
                if s.name == "extproc_rejected_total" and s.labels["reason"] == "shutting_down" and s.value}
    # The two queued ones by their (unnamed: "other") tenant, the newcomer before its tenant counted.
    assert rejected == {"other": 2, "(none)": 1}
    running.close()
    await settle()
    assert dispatcher.in_flight == 0


@pytest.mark.parametrize(
    ("message", "status", "code"),
    [
        (headers_message(model=None), 400, "model_missing"),
        (headers_message(model="other"), 404, "model_not_found"),
    ],
)
async def test_rejections_are_immediate_json_answers(message: pb.ProcessingRequest, status: int, code: str) -> None:
    telemetry = Telemetry()
    processor, dispatcher = make_processor(telemetry)
    stream = Stream(processor, message)
    answer = await stream.answers.get()
    assert answer.immediate_response.status.code == status
    assert f'"code": "{code}"'.encode() in answer.immediate_response.body
    assert dispatcher.queued == 0 and dispatcher.in_flight == 0
    samples = {s.labels["model"] for m in telemetry.registry.collect() for s in m.samples
               if m.name == "extproc_rejected"}
    assert samples == {"(unknown)"}  # neither "other" nor "" became a label value


async def test_unknown_priority_falls_back_to_the_default_band() -> None:
    processor, _ = make_processor()
    headers = {"x-priority": "urgent!!"}
    assert processor.admissions.admit(headers, RequestFields(model="m")).band == CONFIG.band_names.index("standard")
    assert processor.admissions.admit({"x-priority": "Interactive"}, RequestFields(model="m")).band == 0
    assert processor.admissions.admit({}, RequestFields(model="m")).tenant == "anonymous"


# --- entitlements, limits and engine priority -----------------------------------------------

POLICY_CONFIG = parse_config(
    {
        "identity": {"missing_tenant": "reject"},
        "bands": {"batch": {"max_queue_wait_s": 300}},
        "tenants": {
            "default": {"priorities": ["standard", "batch"], "max_queued": 1},
            "vip": {"priorities": ["interactive", "batch"], "default_priority": "batch"},
            "nightly": {"priorities": ["batch"], "default_priority": "batch"},
            "chat": {"priorities": ["interactive"], "default_priority": "interactive"},
        },
        "models": [
            {"name": "m", "endpoints": ["http://127.0.0.1:1"], "advanced": {"fallback_max_in_flight": 1}},
            {"name": "p", "endpoints": ["http://127.0.0.1:2"], "advanced": {"fallback_max_in_flight": 1},
             "engine_priority": True},
        ],
    }
)


def make_policy_processor() -> tuple[Processor, Telemetry]:
    telemetry = Telemetry()
    return Processor(POLICY_CONFIG, build_runtimes(POLICY_CONFIG, telemetry), telemetry), telemetry


@pytest.mark.parametrize(
    ("tenant", "asked", "granted"),
    [
        ("someone", "interactive", "standard"),  # downgraded to the next class it may use
        ("someone", "", "standard"),
        ("someone", "batch", "batch"),
        ("vip", "standard", "batch"),  # vip skips standard: the next lower class it has
        ("vip", "interactive", "interactive"),
        ("nightly", "", "batch"),
        ("nightly", "interactive", "batch"),
    ],
)
def test_a_class_beyond_the_entitlement_is_downgraded_never_upgraded(tenant: str, asked: str, granted: str) -> None:
    processor, _ = make_policy_processor()
    admission = processor.admissions.admit({"x-tenant-id": tenant, "x-priority": asked}, RequestFields(model="m"))
    assert POLICY_CONFIG.band_names[admission.band] == granted
    assert (admission.requested is not None) == (asked not in ("", granted))


def test_no_lower_class_to_fall_back_to_and_no_tenant_are_refused() -> None:
    processor, _ = make_policy_processor()
    with pytest.raises(Refused) as chat:  # asks below everything it may use: granting more would upgrade it
        processor.admissions.admit({"x-tenant-id": "chat", "x-priority": "batch"}, RequestFields(model="m"))
    assert chat.value.refusal is Refusal.PRIORITY_NOT_ALLOWED and ANSWERS[chat.value.refusal].status == 403
    with pytest.raises(Refused) as anonymous:
        processor.admissions.admit({}, RequestFields(model="m"))
    assert anonymous.value.refusal is Refusal.TENANT_MISSING and ANSWERS[anonymous.value.refusal].status == 401


async def test_a_downgrade_is_counted_and_a_tenant_cap_answers_429() -> None:
    processor, telemetry = make_policy_processor()
    first = Stream(processor, headers_message(tenant="someone", priority="interactive"))
    assert (await first.answers.get()).HasField("request_headers")  # released (fallback limit 1)
    queued = Stream(processor, headers_message(tenant="someone"))
    assert (await queued.answers.get()).HasField("override_message_timeout")
    over = Stream(processor, headers_message(tenant="someone"))
    answer = (await over.answers.get()).immediate_response
    assert answer.status.code == 429 and b'"tenant_queue_full"' in answer.body
    headers = {h.header.key: h.header.raw_value.decode() for h in answer.headers.set_headers}
    assert headers["x-extproc-reason"] == "tenant_queue_full" and int(headers["retry-after"]) >= 1
    value = telemetry.registry.get_sample_value(
        "extproc_priority_downgraded_total", {"model": "m", "requested": "interactive", "granted": "standard"}
    )
    assert value == 1
    for stream in (first, queued):
        stream.task.cancel()
    await settle()


async def test_only_engine_priority_models_ask_for_the_body_and_get_it_rewritten() -> None:
    processor, _ = make_policy_processor()
    plain = Stream(processor, headers_message(tenant="vip", model="m"))
    plain_released = await plain.answers.get()
    assert plain_released.mode_override.request_body_mode == plain_released.mode_override.NONE  # headers-only
    prio = Stream(processor, headers_message(tenant="vip", model="p", priority="interactive"))
    released = await prio.answers.get()
    assert released.mode_override.request_body_mode == released.mode_override.BUFFERED
    assert released.mode_override.response_trailer_mode == released.mode_override.SEND  # completion still seen
    prio.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=b'{"model":"p","priority":-5}',
                                                                         end_of_stream=True)))
    mutation = (await prio.answers.get()).request_body.response
    assert json.loads(mutation.body_mutation.body) == {"model": "p", "priority": 0}
    [length] = mutation.header_mutation.set_headers
    assert (length.header.key, length.header.raw_value) == ("content-length", str(len(mutation.body_mutation.body)).encode())
    for stream in (plain, prio):
        stream.close()
    await settle()


def test_the_hold_outlasts_the_longest_class_wait() -> None:
    runtimes = build_runtimes(POLICY_CONFIG, Telemetry())
    processor = Processor(POLICY_CONFIG, runtimes, Telemetry())
    hold = processor.own_envoy.hold_reply(runtimes["m"])
    assert hold is not None and hold.override_message_timeout.seconds == 300 + HOLD_MARGIN_S


def test_no_model_holds_longer_than_the_filter_allows() -> None:
    """Envoy ignores an override above max_message_timeout: fractional waits must not round past it."""
    config = parse_config({"models": [{"name": "a", "endpoints": ["http://127.0.0.1:1"], "max_queue_wait_s": 120.0004},
                                      {"name": "b", "endpoints": ["http://127.0.0.1:2"], "max_queue_wait_s": 0.5}]})
    runtimes = build_runtimes(config, Telemetry())
    processor = Processor(config, runtimes, Telemetry())
    for model in ("a", "b"):
        reply = processor.own_envoy.hold_reply(runtimes[model])
        assert reply is not None and reply.override_message_timeout.ToMilliseconds() / 1000 <= hold_timeout_s(config)
