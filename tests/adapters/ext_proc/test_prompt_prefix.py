"""Prefix signatures from real OpenAI-shaped bodies, the config that turns them on, and the servicer that reads the body.

The servicer is driven the way Envoy drives it behind the generated config
(model in metadata, no body until asked), directly and over real gRPC on the
processor's own HTTP/2 server; tests/stack/test_prefix_envoy.py runs it through a
real Envoy.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.adapters.config import ConfigError, parse_config
from extproc.adapters.grpc.builtin.server import BuiltinServer
from extproc.adapters.grpc.transport import Method
from extproc.adapters.request.prompt_prefix import Signer, leading_text
from extproc.adapters.request.request_fields import Prompt, from_body, prompt_of
from extproc.adapters.server import PROCESS_PATH
from extproc.core.prefix import NO_PREFIX, Prefix
from extproc.core.values.outcomes import Refused
from extproc.tools.procs import free_port
from tests.helpers.epp_stream import BUFFERED, DUPLEX, first_message
from tests.helpers.processor import LateLoop, Stream, settle
from tests.helpers.prompt_prefix import BODY, CHAT, SYSTEM, body_message, headers_message, make

pytestmark = pytest.mark.unit


def config(**model: Any) -> Any:
    return parse_config({"models": [{"name": "m", "endpoints": ["http://127.0.0.1:1"], **model}]})


def prompt(body: dict[str, Any]) -> Prompt:
    return from_body(json.dumps(body).encode())[1]


def test_chat_text_is_role_newline_content_per_message_and_parts_count_their_text_only() -> None:
    assert leading_text(prompt(CHAT), 10**6) == f"system\n{SYSTEM}\nuser\nWhere is my order?\n".encode()
    parts = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "this picture"}]}]}
    assert leading_text(prompt(parts), 10**6) == b"user\nDescribe\nthis picture\n"
    # Unicode counts in bytes, as the engine's blocks do in tokens of the same text.
    assert leading_text(prompt({"messages": [{"role": "user", "content": "héllo"}]}), 8) == "user\nhé".encode()


def test_completions_prompt_is_the_string_or_the_first_of_a_list() -> None:
    assert leading_text(prompt({"model": "m", "prompt": "Once upon a time"}), 100) == b"Once upon a time"
    assert leading_text(prompt({"model": "m", "prompt": ["first", "second"]}), 100) == b"first"
    assert leading_text(prompt({"model": "m", "prompt": [[1, 2, 3]]}), 100) == b""  # token ids: no text


def test_building_stops_at_the_limit() -> None:
    many = {"messages": [{"role": "user", "content": "x" * 1000} for _ in range(1000)]}
    text = leading_text(prompt(many), 2048)
    assert len(text) == 2048 and text.startswith(b"user\nxxx")


@pytest.mark.parametrize("body", [
    {"model": "m"},
    {"model": "m", "messages": None},
    {"model": "m", "messages": "hello"},
    {"model": "m", "messages": [1, 2]},
    {"model": "m", "messages": [{"role": 7, "content": {"odd": True}}]},
    {"model": "m", "messages": [{"content": [{"type": "text"}, "bare string"]}]},
    {"model": "m", "prompt": 3},
    {"model": "m", "prompt": []},
    {"model": "m", "messages": [], "prompt": None},
])
def test_odd_prompts_give_no_signature_never_an_error(body: dict[str, Any]) -> None:
    signer = Signer(config(prefix={}).models[0])
    assert signer.sign(prompt(body), None) == NO_PREFIX


def test_bad_json_is_refused_as_before_and_a_metadata_body_that_is_not_json_gives_no_prompt() -> None:
    with pytest.raises(Refused, match="must be a JSON object"):
        from_body(b'{"model": "m", "messages": [')
    assert leading_text(prompt_of(b"not json"), 100) == b""
    assert leading_text(prompt_of(b"[1, 2]"), 100) == b""


def test_signature_blocks_are_block_tokens_times_bytes_per_token_and_shared_prefixes_share_blocks() -> None:
    signer = Signer(config(prefix={"block_tokens": 64, "max_blocks": 4}, cost={"bytes_per_token": 2.0}).models[0])
    assert signer.block_bytes == 128
    mine = signer.sign(prompt(CHAT), "support")
    other_question = dict(CHAT, messages=[CHAT["messages"][0], {"role": "user", "content": "Refund please"}])
    theirs = signer.sign(prompt(other_question), None)
    assert isinstance(mine, Prefix) and len(mine.blocks) == 4 and mine.block_tokens == 64 and mine.key == "support"
    assert mine.blocks == theirs.blocks  # the same system prompt: the same leading blocks
    different = signer.sign(prompt(dict(CHAT, messages=[{"role": "system", "content": "Other. " * 100}])), None)
    assert not set(different.blocks) & set(mine.blocks)
    # A prompt shorter than a block still carries the client's key (routing affinity).
    assert signer.sign(prompt({"messages": [{"role": "user", "content": "hi"}]}), "k") == Prefix((), 64.0, "k")


def test_prefix_config_defaults_locality_implies_it_and_mistakes_name_the_key() -> None:
    assert config().models[0].prefix is None
    [model] = config(prefix={}).models
    assert (model.prefix is not None and (model.prefix.block_tokens, model.prefix.max_blocks) == (128, 16)
            and Signer(model).block_bytes == 512 and model.cost_weights().cached_input_weight == 0.1)
    [locality] = config(policy="locality").models
    assert locality.prefix is not None and locality.prefix.max_blocks == 16
    assert config(prefix={"cached_input_weight": 0.25}).models[0].cost_weights().cached_input_weight == 0.25
    for written, path in [({"block_tokens": 0}, "models[0].prefix.block_tokens"),
                          ({"max_blocks": 1000}, "models[0].prefix.max_blocks"),
                          ({"cached_input_weight": 2.0}, "models[0].prefix.cached_input_weight"),
                          ({"blocks": 3}, "models[0].prefix")]:
        with pytest.raises(ConfigError, match=path.replace("[", r"\[").replace("]", r"\]")):
            config(prefix=written)


# --- the servicer, as Envoy drives it behind the generated config --------------------------


async def test_a_model_with_signatures_asks_for_the_body_first_and_releases_in_the_body_reply() -> None:
    processor, _, submitted = make(prefix={})
    stream = Stream(processor, headers_message(BODY))
    first = await stream.answers.get()
    # The headers answered without a decision: the body wanted (buffered), the response headers too.
    assert first.HasField("request_headers") and not first.request_headers.response.header_mutation.set_headers
    assert first.mode_override.request_body_mode == first.mode_override.BUFFERED
    assert first.mode_override.response_header_mode == first.mode_override.SEND
    assert first.mode_override.response_trailer_mode == first.mode_override.SEND
    assert submitted == []  # not queued before its body came
    stream.send(body_message(BODY))
    released = await stream.answers.get()
    common = released.request_body.response
    headers = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}
    assert headers["x-model"] == b"m" and "x-extproc-queue-wait-ms" in headers and common.clear_route_cache
    assert not common.HasField("body_mutation")  # passed on as it came
    [prefix] = submitted
    assert len(prefix.blocks) == 2 and prefix.blocks == Signer(config(prefix={}).models[0]).sign(prompt(CHAT), None).blocks
    stream.close()
    await settle()


async def test_a_model_without_signatures_keeps_the_headers_only_path() -> None:
    processor, _, submitted = make()
    stream = Stream(processor, headers_message(BODY))
    released = await stream.answers.get()
    assert released.request_headers.response.header_mutation.set_headers  # the release, at once
    assert released.mode_override.request_body_mode == released.mode_override.NONE
    assert submitted == [NO_PREFIX]
    stream.close()
    await settle()


async def test_engine_priority_with_signatures_writes_the_priority_into_the_body_reply() -> None:
    processor, _, submitted = make(prefix={}, engine_priority=True)
    stream = Stream(processor, headers_message(BODY))
    await stream.answers.get()
    stream.send(body_message(BODY))
    common = (await stream.answers.get()).request_body.response
    rewritten = common.body_mutation.body
    assert json.loads(rewritten) == {**CHAT, "priority": 1}  # the default class, standard: the second
    headers = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}
    assert headers["content-length"] == str(len(rewritten)).encode() and headers["x-model"] == b"m"
    assert len(submitted[0].blocks) == 2
    stream.close()
    await settle()


async def test_an_operators_metadata_text_is_signed_without_the_body() -> None:
    processor, _, submitted = make(prefix={"block_tokens": 2, "max_blocks": 3})  # 8-byte blocks
    stream = Stream(processor, headers_message(BODY, {"prompt_prefix": "0123456789abcdefXYZ"}))
    released = await stream.answers.get()
    assert released.request_headers.response.header_mutation.set_headers  # released on the headers: no body asked
    [prefix] = submitted
    assert prefix.blocks == Signer(config(prefix={"block_tokens": 2, "max_blocks": 3}).models[0]).sign(
        Prompt(text=b"0123456789abcdefXYZ"), None).blocks and len(prefix.blocks) == 2
    stream.close()
    await settle()


async def test_a_queued_request_with_signatures_is_held_on_its_body_message() -> None:
    processor, dispatcher, submitted = make(prefix={}, advanced={"fallback_max_in_flight": 1}, gate="static_concurrency",
                                            max_in_flight=1)
    first = Stream(processor, headers_message(BODY))
    await first.answers.get()
    first.send(body_message(BODY))
    assert (await first.answers.get()).HasField("request_body")  # released: it takes the one slot
    second = Stream(processor, headers_message(BODY))
    await second.answers.get()
    second.send(body_message(BODY))
    hold = await second.answers.get()
    assert hold.HasField("override_message_timeout")  # extends the body message's timer while queued
    assert dispatcher.queued == 1
    first.close()  # the first ends: the second is released, on its body message
    released = await asyncio.wait_for(second.answers.get(), 5)
    assert released.HasField("request_body") and released.request_body.response.clear_route_cache
    assert len(submitted) == 2 and submitted[0].blocks == submitted[1].blocks
    second.close()
    await settle()


async def test_a_late_loop_acknowledges_the_body_message_too() -> None:
    processor, _, _ = make(prefix={}, gate="static_concurrency", max_in_flight=1)
    processor.lag = LateLoop(0.2)  # the loop runs late (not yet for long: no shedding)
    occupying = Stream(processor, headers_message(BODY))
    assert (await occupying.answers.get()).HasField("override_message_timeout")  # the headers' acknowledgement
    assert (await occupying.answers.get()).mode_override.request_body_mode == BUFFERED
    occupying.send(body_message(BODY))
    assert (await occupying.answers.get()).HasField("override_message_timeout")  # the body's own: Envoy took one per message
    assert (await occupying.answers.get()).HasField("request_body")  # released
    waiting = Stream(processor, headers_message(BODY))
    for _ in range(2):
        await waiting.answers.get()
    waiting.send(body_message(BODY))
    assert (await waiting.answers.get()).HasField("override_message_timeout")
    await settle()
    assert waiting.answers.empty()  # queued: the acknowledgement was its hold, no second override (Envoy ignores it)
    occupying.close()
    assert (await asyncio.wait_for(waiting.answers.get(), 5)).HasField("request_body")
    waiting.close()
    await settle()


@pytest.mark.parametrize("mode", [BUFFERED, DUPLEX])
async def test_attached_by_ext_proc_alone_the_body_read_for_its_fields_gives_the_signature(mode: int) -> None:
    processor, _, submitted = make(prefix={})
    stream = Stream(processor, first_message(mode, {"x-tenant-id": "t"}))
    stream.send(body_message(BODY))
    while not (answer := await asyncio.wait_for(stream.answers.get(), 5)).HasField("request_body"):
        assert not answer.HasField("immediate_response"), answer
    [prefix] = submitted
    assert prefix.blocks == Signer(config(prefix={}).models[0]).sign(prompt(CHAT), None).blocks and len(prefix.blocks) == 2
    stream.close()
    await settle()


async def test_over_real_grpc_the_body_comes_before_the_release() -> None:
    processor, _, submitted = make(prefix={})
    server = BuiltinServer({PROCESS_PATH: Method(pb.ProcessingRequest.FromString, processor.process)})
    port = free_port()
    await server.start("127.0.0.1", port)
    channel: Any = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        call = channel.stream_stream(PROCESS_PATH, request_serializer=pb.ProcessingRequest.SerializeToString,
                                     response_deserializer=pb.ProcessingResponse.FromString)()
        await call.write(headers_message(BODY))
        first = await call.read()
        assert first.mode_override.request_body_mode == first.mode_override.BUFFERED and submitted == []
        await call.write(body_message(BODY))
        released = await call.read()
        assert released.HasField("request_body") and released.request_body.response.header_mutation.set_headers
        assert len(submitted) == 1 and len(submitted[0].blocks) == 2
        await call.write(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
        assert (await call.read()).HasField("response_trailers")
        await call.done_writing()
    finally:
        await channel.close()
        await server.stop(0)
