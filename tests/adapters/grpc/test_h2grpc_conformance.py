"""Our HTTP/2 layer against the ``h2`` library's state machine: the same bytes, the same events, the same errors.

Generated conversations (valid frames, frames that break a rule, bytes flipped, all split anywhere)
are fed to both servers: http2.Http2Connection and h2.connection.H2Connection (server side,
python-hyper's, maintained and used by httpx, hypercorn and grpclib). Both must report the same
events and send the same answers (RST_STREAM, GOAWAY, PING and SETTINGS acknowledgements), and must
end the connection at the same byte with the same error code, in a common vocabulary:

- events: a stream's request (its headers), its data (bytes and flow-controlled length), its end, a
  reset by the peer, the peer's SETTINGS, a PING's answer, the peer's GOAWAY. What h2 reports and we
  do not (priority changes, trailers' fields, our SETTINGS acknowledged, unknown frames) is dropped:
  the transport reads none of them. Our send windows are compared after each piece instead of
  h2's window events;
- answers: the frames each queued, WINDOW_UPDATE apart (when to give window back is each one's policy).

Where the two legitimately differ, the difference is narrow and written here (``_normalised``,
``_diverged``), and docs/decisions.md lists it:

1. a header block HPACK cannot decode: RFC 9113 (4.3) says COMPRESSION_ERROR, as we answer; h2
   answers PROTOCOL_ERROR (ENHANCE_YOUR_CALM for a list over SETTINGS_MAX_HEADER_LIST_SIZE);
2. where RFC 9113 asks for a *stream* error (DATA or HEADERS on a stream the peer ended, 5.1;
   trailers without END_STREAM, 8.1; a stream depending on itself, 5.3.1), h2 ends the connection;
   the comparison stops there, having checked that we reset that stream with the code h2 ended the
   connection with;
3. frames on a stream we reset, sent before the peer saw our RST_STREAM: RFC 9113 (5.1) says to
   ignore them, as we do; h2 answers RST_STREAM STREAM_CLOSED. Streams we reset are not written
   to by the generator, except through flipped bytes, whose comparison stops there;
4. a frame longer than SETTINGS_MAX_FRAME_SIZE: we end the connection on its 9-byte header (FRAME_SIZE_ERROR);
   h2 checks the header's stream id first (PROTOCOL_ERROR if it is wrong), then buffers the whole frame, up
   to 16 MiB, before ending it with FRAME_SIZE_ERROR;
5. a client's PUSH_PROMISE: RFC 9113 (8.4) says PROTOCOL_ERROR (a client cannot push), as we answer; h2
   takes it, or refuses it as too short for its promised stream id (FRAME_SIZE_ERROR);
6. a frame whose length its type does not allow (a SETTINGS ACK with a payload, 6.5): RFC 9113 says
   FRAME_SIZE_ERROR, as we answer; h2 answers PROTOCOL_ERROR (hyperframe finds the payload "non-compliant");
7. the peer's GOAWAY: RFC 9113 (6.8) lets the streams up to its last id finish, and we read on; h2 takes
   it for the end of the connection (drops what it had queued, refuses every later frame). The comparison
   stops after the GOAWAY's event;
8. a malformed frame (a WINDOW_UPDATE of 7 bytes) inside a header block breaks two rules: we name the
   interleaving (PROTOCOL_ERROR, 6.10), h2 the length (FRAME_SIZE_ERROR), which it checks first;
9. a RST_STREAM on an idle stream: RFC 9113 (6.4) says PROTOCOL_ERROR, as we answer; h2 takes it (opening
   and closing the stream);
10. a frame on a stream its type does not allow (a PING on stream 1): h2 refuses it on its 9-byte header,
   we once it is whole: where the bytes end inside it, only h2 has refused it yet;
11. a WINDOW_UPDATE with its reserved bit set: RFC 9113 (6.9) says to ignore the bit, as we do; h2
   refuses it (hyperframe finds it "non-compliant");
12. an ALTSVC frame (RFC 7838), an extension a server does not use: we ignore it as any frame of a type
   we do not know (RFC 9113, 4.1); h2 parses it, and ends the connection on a malformed one;
13. a CONTINUATION not preceded by its HEADERS, on a closed stream: RFC 9113 (6.10) says PROTOCOL_ERROR,
   as we answer; h2 answers STREAM_CLOSED.

The flood limits (builtin/flood.py) are ours, not the RFC's: lifted here (test_h2grpc_flood.py tests them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest
from hpack import Encoder
from hyperframe.frame import Frame
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.adapters.config import GrpcLimits
from extproc.adapters.grpc.builtin import frames as f
from extproc.adapters.grpc.builtin import http2
from extproc.adapters.grpc.builtin.frames import ErrorCode
from extproc.adapters.grpc.builtin.http2 import Http2Connection, Http2Error
from tests.propertyutil import examples

pytestmark = pytest.mark.unit

STREAM_WINDOW, CONNECTION_WINDOW, HEADER_LIST = 2**20, 2**24, 16 * 1024
UNLIMITED = GrpcLimits(max_outbound_frames=2**31, max_outbound_control_frames=2**31,
                       max_consecutive_inbound_frames_with_empty_payload=2**31,
                       max_inbound_priority_frames_per_stream=2**31,
                       max_inbound_window_update_frames_per_data_frame_sent=2**31,
                       max_continuation_frames=2**31, max_frames_per_read=2**31)
REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/t.T/Echo"), (b":authority", b"t"),
           (b"content-type", b"application/grpc")]
# The opening every conversation starts with, never flipped: the preface, a SETTINGS, and the
# acknowledgement of the server's (h2 applies its own SETTINGS once acknowledged; we from the start).
OPENING = f.PREFACE + f.settings({}) + f.frame(f.SETTINGS, f.ACK, 0)


# --- the two servers, in one vocabulary -------------------------------------------------------------------------


def ours() -> Http2Connection:
    conn = Http2Connection(max_streams=2**31 - 1, stream_window=STREAM_WINDOW, connection_window=CONNECTION_WINDOW,
                           max_header_list=HEADER_LIST, limits=UNLIMITED)
    conn.initiate_connection()
    conn.data_to_send()
    conn.data_frames_sent = 2**20  # WINDOW_UPDATEs are allowed per DATA frame sent: as if many were
    return conn


def theirs() -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=False, header_encoding=None, validate_inbound_headers=False, normalize_inbound_headers=False,
        validate_outbound_headers=False, normalize_outbound_headers=False))
    conn.local_settings = h2.settings.Settings(client=False, initial_values={
        h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 2**31 - 1,
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
        h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: HEADER_LIST})
    conn.initiate_connection()
    conn.increment_flow_control_window(CONNECTION_WINDOW - f.DEFAULT_WINDOW)
    conn.data_to_send()
    return conn


Said = tuple[Any, ...]


def our_events(events: list[http2.Event]) -> list[Said]:
    said: list[Said] = []
    for kind, stream_id, value, size in events:
        if kind == http2.REQUEST:
            said.append(("request", stream_id, tuple(value)))
        elif kind == http2.DATA:
            said.append(("data", stream_id, bytes(value), size))
        elif kind == http2.ENDED:
            said.append(("ended", stream_id))
        elif kind == http2.RESET:
            said.append(("reset", stream_id))
        elif kind == http2.SETTLED:
            said.append(("settings",))
        elif kind == http2.PONG:
            said.append(("pong", bytes(value)))
        elif kind == http2.GOING_AWAY:
            said.append(("goaway", value[0], size, bytes(value[1])))
    return said


def their_events(events: list[h2.events.Event]) -> list[Said]:
    said: list[Said] = []
    for event in events:
        if isinstance(event, h2.events.RequestReceived):
            said.append(("request", event.stream_id, tuple(event.headers or ())))
        elif isinstance(event, h2.events.DataReceived):
            said.append(("data", event.stream_id, bytes(event.data or b""), event.flow_controlled_length))
        elif isinstance(event, h2.events.StreamEnded):
            said.append(("ended", event.stream_id))
        elif isinstance(event, h2.events.StreamReset):
            said.append(("reset", event.stream_id))
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            said.append(("settings",))
        elif isinstance(event, h2.events.PingAckReceived):
            said.append(("pong", bytes(event.ping_data or b"")))
        elif isinstance(event, h2.events.ConnectionTerminated):
            said.append(("goaway", int(event.error_code or 0), event.last_stream_id, bytes(event.additional_data or b"")))
    # A stream error of h2's own resets the stream with no event; ours reports the reset of an open stream.
    return said


def answers(data: bytes) -> list[Said]:
    """The frames a server queued, but WINDOW_UPDATEs, as (type, stream, detail)."""
    out: list[Said] = []
    while data:
        frame: Any
        frame, length = Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9:9 + length]))
        data = data[9 + length:]
        if frame.type == f.RST_STREAM:
            out.append(("rst", frame.stream_id, frame.error_code))
        elif frame.type == f.GOAWAY:  # its code is the connection error's, compared as such (their_code)
            out.append(("goaway", frame.last_stream_id))
        elif frame.type == f.PING:
            out.append(("ping ack", bytes(frame.opaque_data)))
        elif frame.type == f.SETTINGS:
            out.append(("settings ack",))
    return out


ALTSVC = 0xA


def frame_types(data: bytes) -> set[int]:
    """The types of the frames in ``data``, after the opening (difference 12)."""
    types, at = set(), len(OPENING)
    while at + 9 <= len(data):
        types.add(data[at + 3])
        at += 9 + int.from_bytes(data[at:at + 3], "big")
    return types


def their_code(exc: h2.exceptions.ProtocolError) -> int:
    """h2's connection error as RFC 9113 names it (difference 1)."""
    if isinstance(exc, h2.exceptions.DenialOfServiceError) or str(exc).startswith("Error decoding header block"):
        return ErrorCode.COMPRESSION_ERROR
    return int(exc.error_code)


def same_error(run: Run) -> bool:
    """Both ended the connection with the same error (or neither did), as RFC 9113 names it (differences 6, 8)."""
    if run.our_error == ErrorCode.FRAME_SIZE_ERROR and run.their_message == "Received frame with non-compliant data":
        return True  # hyperframe's InvalidDataError, which h2 answers PROTOCOL_ERROR, was a wrong length
    if "not followed by its CONTINUATION" in run.our_message and run.their_error == ErrorCode.FRAME_SIZE_ERROR:
        return True  # a malformed frame inside a header block: two rules broken, each names one
    if "CONTINUATION without the HEADERS" in run.our_message and run.their_error == ErrorCode.STREAM_CLOSED:
        return True  # 13: a stray CONTINUATION on a closed stream
    if run.our_error is None and run.pending and run.their_message.startswith("Received frame with invalid header"):
        return True  # 10: h2 refused a frame on its header, we wait for the rest of it
    return run.our_error == run.their_error


@dataclass
class Run:
    """Both servers fed the same pieces; what each said, and where the comparison stopped and why."""

    ours: list[Said] = field(default_factory=list)
    theirs: list[Said] = field(default_factory=list)
    our_error: int | None = None
    our_message: str = ""
    their_error: int | None = None
    their_message: str = ""
    pending: bool = False  # ours holds part of a frame, waiting for the rest
    altsvc: bool = False  # an ALTSVC frame (type 0xA) was sent
    our_goaway: list[Said] = field(default_factory=list)
    their_goaway: list[Said] = field(default_factory=list)
    stopped: str = ""


def feed(pieces: list[bytes]) -> Run:
    """Feed both, piece by piece, comparing as they go; once one ends the connection, the other is fed on until it
    does too (a frame refused on its 9-byte header by one may be refused once whole by the other, a few bytes
    later): from the piece where either ended it, only the GOAWAYs are compared, and the error codes at the end."""
    us, them = ours(), theirs()
    run = Run(altsvc=ALTSVC in frame_types(b"".join(pieces)))
    resets: set[int] = set()
    for piece in pieces:
        said: list[Said] = []
        heard: list[Said] = []
        if run.our_error is None:
            try:
                said = our_events(us.receive_data(piece))
            except Http2Error as exc:
                run.our_error, run.our_message = int(exc.code), str(exc)
        if run.their_error is None:
            try:
                heard = their_events(them.receive_data(piece))
            except h2.exceptions.ProtocolError as exc:
                run.their_error, run.their_message = their_code(exc), str(exc)
        our_out, their_out = answers(us.data_to_send()), answers(them.data_to_send())
        if any(h[0] == "goaway" for h in heard) and run.our_error is None:
            # 7: h2 takes the peer's GOAWAY for the end (what it had queued dropped, every later frame refused).
            run.ours += said
            run.theirs += _normalised(heard, said)
            run.stopped = "h2 ends the connection on the peer's GOAWAY"
            return run
        resets |= {o[1] for o in our_out if o[0] == "rst"}
        stop = _diverged(run, our_out, their_out, resets)
        if stop:
            run.stopped = stop
            return run
        if run.our_error is None and run.their_error is None:
            run.ours += said + our_out
            run.theirs += _normalised(heard, said) + their_out
            for stream_id in list(us.streams):
                assert us.local_flow_control_window(stream_id) == them.local_flow_control_window(stream_id), stream_id
            assert us.outbound_flow_control_window == them.outbound_flow_control_window
        else:  # the GOAWAYs' last stream ids, compared once both ended the connection
            run.our_goaway += [o for o in our_out if o[0] == "goaway"]
            run.their_goaway += [o for o in their_out if o[0] == "goaway"]
        if run.our_error is not None and run.their_error is not None:
            break
    run.pending = us.unparsed >= f.HEADER_SIZE
    return run


def _normalised(heard: list[Said], said: list[Said]) -> list[Said]:
    """h2's events, with the resets of open streams that a stream error of ours reports as events added back."""
    ours_resets = [s for s in said if s[0] == "reset"]
    return heard + [r for r in ours_resets if r not in heard]


def _diverged(run: Run, our_out: list[Said], their_out: list[Said], resets: set[int]) -> str:
    """Where the comparison stops: a legitimate difference (2 or 3 above), checked as narrowly as it can be."""
    our_rsts = {(o[1], o[2]) for o in our_out if o[0] == "rst"}
    if run.our_message.startswith("FRAME_SIZE_ERROR: a frame of") and (
            run.their_error is None or "invalid header" in run.their_message):
        return "h2 waits for the whole of a frame longer than SETTINGS_MAX_FRAME_SIZE"  # 4
    if run.altsvc and run.our_error is None and run.their_message == "Frame data missing or invalid":
        return "h2 parses an ALTSVC frame, an extension a server ignores"  # 12
    if run.their_message == "Received frame with non-compliant data" and run.our_error is None:
        return "h2 refuses a frame's reserved bit, or a field RFC 9113 lets us ignore"  # 11
    if "RST_STREAM on idle stream" in run.our_message:
        return "h2 takes a RST_STREAM on an idle stream"  # 9
    if "in state ConnectionState.CLOSED" in run.their_message:  # 7, the GOAWAY in the same piece
        return "h2 ends the connection on the peer's GOAWAY"
    if "PUSH_PROMISE" in run.our_message:
        return "h2 takes a client's PUSH_PROMISE, or refuses it as short"  # 5
    if run.their_error is not None:
        # 2: h2 ends the connection where RFC 9113 asks for a stream error: we reset a stream with that code (and
        # read on: a later frame of the same piece may end ours).
        if run.their_error in {code for _, code in our_rsts}:
            return "h2 made a stream error a connection error"
    if run.our_error is None and run.their_error is None:
        extra = Counter(o[1:] for o in their_out if o[0] == "rst") - Counter(o[1:] for o in our_out if o[0] == "rst")
        # 3: h2 answers frames on a stream we had reset; RFC 9113 says to ignore them, as we do.
        if extra and all(code == ErrorCode.STREAM_CLOSED and s in resets for s, code in extra):
            return "h2 answered a frame on a stream we had reset"
    return ""


# --- generated conversations -----------------------------------------------------------------------------------

Action = Callable[["Writer"], bytes]


class Writer:
    """A client's frames: stream ids as a client would choose them (or not), header blocks from one HPACK encoder."""

    def __init__(self) -> None:
        self.encoder = Encoder()
        self.next_stream = 1
        self.open: list[int] = []

    def stream(self, pick: int) -> int:
        """0: a new stream; 1-3: an open one (or a new one if none); 4: 0; 5: an even id; 6: a lower, closed id."""
        if pick == 0 or (pick <= 3 and not self.open):
            stream_id = self.next_stream
            self.next_stream += 2
            self.open.append(stream_id)
            return stream_id
        if pick <= 3:
            return self.open[(pick - 1) % len(self.open)]
        return {4: 0, 5: 2 * pick, 6: max(1, self.next_stream - 4)}[pick]


def headers(pick: int, end_stream: bool, split: int, padded: bool, priority: int, extra: bytes) -> Action:
    def write(w: Writer) -> bytes:
        stream_id = w.stream(pick)
        block = w.encoder.encode([*REQUEST, (b"x-extra", extra)])
        flags = f.END_STREAM if end_stream else 0
        prefix = b""
        if priority:
            flags |= f.PRIORITY_FLAG
            prefix = (stream_id if priority == 2 else 0).to_bytes(4, "big") + b"\x10"
        if padded:
            flags |= f.PADDED
            prefix = b"\x02" + prefix
        pieces = [block[i:i + max(1, split)] for i in range(0, len(block), max(1, split))] if split else [block]
        first = prefix + pieces[0] + (b"\0\0" if padded else b"")
        out = f.frame(f.HEADERS, flags | (f.END_HEADERS if len(pieces) == 1 else 0), stream_id, first)
        for i, piece in enumerate(pieces[1:], 2):
            out += f.frame(f.CONTINUATION, f.END_HEADERS if i == len(pieces) else 0, stream_id, piece)
        if end_stream and stream_id in w.open:
            w.open.remove(stream_id)
        return out
    return write


def frame(kind: int, flags: int, pick: int, payload: bytes) -> Action:
    def write(w: Writer) -> bytes:
        if 1 <= pick <= 3 and not w.open:
            return b""  # on an open stream, and none is
        stream_id = w.stream(pick)
        if (kind == f.RST_STREAM or flags & f.END_STREAM and kind == f.DATA) and stream_id in w.open:
            w.open.remove(stream_id)
        return f.frame(kind, flags, stream_id, payload)
    return write


PADDED_DATA = st.builds(lambda data: b"\x03" + data + b"\0\0\0", st.binary(max_size=40))
SETTINGS = st.sampled_from([f.HEADER_TABLE_SIZE, f.ENABLE_PUSH, f.MAX_CONCURRENT_STREAMS, f.INITIAL_WINDOW_SIZE,
                            f.MAX_FRAME_SIZE, f.MAX_HEADER_LIST_SIZE, 0x99])
# What a well-behaved client sends: new streams and open ones, frames of the right sizes, values within range.
VALID = st.one_of(
    st.builds(headers, st.integers(0, 3), st.booleans(), st.sampled_from([0, 0, 0, 7, 40]), st.booleans(),
              st.sampled_from([0, 0, 1]), st.binary(max_size=30)),
    st.builds(frame, st.just(f.DATA), st.sampled_from([0, f.END_STREAM]), st.integers(1, 3), st.binary(max_size=60)),
    st.builds(frame, st.just(f.DATA), st.sampled_from([f.PADDED, f.PADDED | f.END_STREAM]), st.integers(1, 3),
              PADDED_DATA),
    st.builds(frame, st.just(f.RST_STREAM), st.just(0), st.integers(1, 3), st.just(b"\0\0\0\x08")),
    st.builds(frame, st.just(f.WINDOW_UPDATE), st.just(0), st.integers(1, 3), st.sampled_from([b"\0\0\x10\0", b"\0\0\0\x01"])),
    st.builds(lambda payload: lambda w: f.frame(f.WINDOW_UPDATE, 0, 0, payload), st.just(b"\0\0\x10\0")),
    st.builds(lambda values: lambda w: f.settings(values), st.dictionaries(
        SETTINGS, st.sampled_from([0, 1, 100, 16_384, 65_535, 2**20, 2**24 - 1]), max_size=3).map(
            lambda v: {k: x for k, x in v.items() if not (k == f.ENABLE_PUSH and x > 1)
                       and not (k == f.MAX_FRAME_SIZE and not 16_384 <= x < 2**24)})),
    st.builds(lambda flags: lambda w: f.frame(f.PING, flags, 0, b"12345678"), st.sampled_from([0, f.ACK])),
    st.builds(frame, st.just(f.PRIORITY), st.just(0), st.integers(0, 3), st.just(b"\0\0\0\x00\x10")),
    st.builds(frame, st.sampled_from([0x20, 0xFA]), st.just(0), st.integers(0, 3), st.binary(max_size=8)),
)
# And what breaks a rule: wrong streams, sizes, values, frames a client may not send.
ABUSIVE = st.one_of(
    st.builds(headers, st.integers(0, 6), st.booleans(), st.sampled_from([0, 0, 0, 7, 40]), st.booleans(),
              st.sampled_from([0, 0, 1, 2]), st.binary(max_size=30)),
    st.builds(frame, st.just(f.DATA), st.sampled_from([0, f.END_STREAM, f.PADDED]), st.integers(1, 6),
              st.binary(max_size=60)),
    st.builds(frame, st.just(f.RST_STREAM), st.just(0), st.integers(1, 6),
              st.sampled_from([b"\0\0\0\x08", b"\0\0\0\x00", b"\0\0\x08"])),
    st.builds(frame, st.just(f.WINDOW_UPDATE), st.just(0), st.integers(1, 6),
              st.sampled_from([b"\0\0\x10\0", b"\0\0\0\0", b"\x7f\xff\xff\xff", b"\0\0\x01"])),
    st.builds(lambda payload: lambda w: f.frame(f.WINDOW_UPDATE, 0, 0, payload),
              st.sampled_from([b"\0\0\0\0", b"\x7f\xff\xff\xff"])),
    st.builds(lambda values: lambda w: f.settings(values), st.dictionaries(
        SETTINGS, st.sampled_from([0, 1, 2, 16_383, 2**24, 2**31 - 1, 2**31]), max_size=3)),
    st.builds(lambda payload, flags: lambda w: f.frame(f.SETTINGS, flags, 0, payload),
              st.sampled_from([b"", b"\0" * 5]), st.sampled_from([0, f.ACK])),
    st.builds(lambda data, flags, stream: lambda w: f.frame(f.PING, flags, stream, data),
              st.sampled_from([b"12345678", b"1234567"]), st.sampled_from([0, f.ACK]), st.sampled_from([0, 1])),
    st.builds(frame, st.just(f.PRIORITY), st.just(0), st.integers(0, 6),
              st.sampled_from([b"\0\0\0\x01\x10", b"\0\0\0\x03\x10", b"\0\0\0\0"])),
    st.builds(lambda payload, stream: lambda w: f.frame(f.GOAWAY, 0, stream, payload),
              st.sampled_from([b"\0\0\0\x01\0\0\0\x00", b"\0\0\0\x01\0\0\0\x0bcalm", b"\0\0\0"]),
              st.sampled_from([0, 0, 1])),
    st.builds(frame, st.sampled_from([f.PUSH_PROMISE, f.CONTINUATION]), st.sampled_from([0, f.END_HEADERS]),
              st.integers(1, 6), st.binary(max_size=8)),
)


@st.composite
def conversations(draw: st.DrawFn) -> list[bytes]:
    """A conversation's bytes: valid frames, with (in a third) some that break a rule, and (in a tenth) a byte
    flipped after the opening; in pieces cut anywhere."""
    writer = Writer()
    actions = draw(st.lists(st.one_of(VALID, ABUSIVE) if draw(st.integers(0, 2)) == 0 else VALID, max_size=16))
    data = OPENING + b"".join(action(writer) for action in actions)
    if draw(st.integers(0, 9)) == 0 and len(data) > len(OPENING):
        at = draw(st.integers(len(OPENING), len(data) - 1))
        data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1:]
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=8))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


@settings(max_examples=examples(1500), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations())
def test_our_layer_says_what_h2_says_of_the_same_bytes(pieces: list[bytes]) -> None:
    run = feed(pieces)
    assert run.ours == run.theirs
    if not run.stopped:
        assert same_error(run), run
        if run.our_error is not None and run.their_error is not None:
            assert run.our_goaway == run.their_goaway


def _request(stream_id: int, end_stream: bool = False, priority: bytes = b"") -> bytes:
    flags = f.END_HEADERS | (f.END_STREAM if end_stream else 0) | (f.PRIORITY_FLAG if priority else 0)
    return f.frame(f.HEADERS, flags, stream_id, priority + Encoder().encode(REQUEST))


DIFFERENCES = {
    2: ([OPENING + _request(1, priority=(1).to_bytes(4, "big") + b"\x10")], "h2 made a stream error a connection error"),
    3: ([OPENING + _request(1, True) + f.frame(f.DATA, 0, 1, b"x") * 2], "h2 answered a frame on a stream we had reset"),
    4: ([OPENING + (70_000).to_bytes(3, "big") + bytes([f.DATA, 0]) + (1).to_bytes(4, "big") + b"x" * 100],
        "h2 waits for the whole of a frame longer than SETTINGS_MAX_FRAME_SIZE"),
    5: ([OPENING + _request(1) + f.frame(f.PUSH_PROMISE, f.END_HEADERS, 1, b"\0\0\0\x02")],
        "h2 takes a client's PUSH_PROMISE, or refuses it as short"),
    7: ([OPENING + f.goaway(0, 0) + f.ping(b"12345678")], "h2 ends the connection on the peer's GOAWAY"),
    9: ([OPENING + f.rst_stream(1, 8)], "h2 takes a RST_STREAM on an idle stream"),
    11: ([OPENING + f.frame(f.WINDOW_UPDATE, 0, 0, b"\x80\0\x10\0")],
         "h2 refuses a frame's reserved bit, or a field RFC 9113 lets us ignore"),
    12: ([OPENING + f.frame(ALTSVC, 0, 1, b"\x00")], "h2 parses an ALTSVC frame, an extension a server ignores"),
}


@pytest.mark.parametrize("number", list(DIFFERENCES))
def test_each_difference_where_the_comparison_stops_still_happens(number: int) -> None:
    """Else it is no longer a difference, and goes from the list (the module's docstring and docs/decisions.md)."""
    pieces, reason = DIFFERENCES[number]
    assert feed(pieces).stopped == reason


@pytest.mark.parametrize(("pieces", "ours_code", "h2_code"), [
    ([OPENING + f.frame(f.HEADERS, f.END_HEADERS, 1, b"\xff\xff\xff\xff")],
     ErrorCode.COMPRESSION_ERROR, ErrorCode.PROTOCOL_ERROR),  # 1
    ([OPENING + f.frame(f.SETTINGS, f.ACK, 0, b"\0" * 6)], ErrorCode.FRAME_SIZE_ERROR, ErrorCode.PROTOCOL_ERROR),  # 6
    ([OPENING + f.frame(f.HEADERS, 0, 1, Encoder().encode(REQUEST)) + f.frame(f.WINDOW_UPDATE, 0, 0, b"\0" * 7)],
     ErrorCode.PROTOCOL_ERROR, ErrorCode.FRAME_SIZE_ERROR),  # 8
    ([OPENING + f.frame(f.PING, 0, 1, b"12345678")[:12]], None, ErrorCode.PROTOCOL_ERROR),  # 10
    ([OPENING + f.frame(f.PRIORITY, 0, 1, b"\0\0\0\0\x10") + _request(3) + f.frame(f.CONTINUATION, 0, 1)],
     ErrorCode.PROTOCOL_ERROR, ErrorCode.STREAM_CLOSED),  # 13
])
def test_each_difference_in_error_codes_still_happens(pieces: list[bytes], ours_code: int | None, h2_code: int) -> None:
    run = feed(pieces)
    them = theirs()
    with pytest.raises(h2.exceptions.ProtocolError) as raised:
        for piece in pieces:
            them.receive_data(piece)
    assert (run.our_error, raised.value.error_code) == (ours_code, h2_code)
    assert same_error(run)
