"""HTTP/2 frames as bytes (RFC 9113, sections 4 and 6): the frame header, the codes, and the frames this server sends.

A frame is a 9-byte header (24-bit payload length, type, flags, a reserved
bit and a 31-bit stream id) and its payload. builtin/http2.py reads frames
with :data:`HEADER` and writes them with the builders here; they check
nothing a caller controls (the connection sends only what its state allows).
"""

from __future__ import annotations

import struct
from enum import IntEnum

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# The header: the length as 16 + 8 bits (struct has no 24-bit integer), type, flags, reserved bit and stream id.
HEADER = struct.Struct(">HBBBL")
HEADER_SIZE = HEADER.size
STREAM_MASK = 0x7FFF_FFFF
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384  # the most a peer may send us: we never advertise more
LARGEST_FRAME_SIZE = 2**24 - 1

# Frame types (RFC 9113, 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# Flags.
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# Settings (RFC 9113, 6.5.2).
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = (
    range(1, 7))
# The response headers of every gRPC reply, and as a block: ":status: 200" from HPACK's static table and
# content-type a literal that is not indexed, so the encoder's dynamic table (the trailers') is untouched.
RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]
RESPONSE_BLOCK = b"\x88\x0f\x10\x10application/grpc"
RESPONSE_FRAME = len(RESPONSE_BLOCK).to_bytes(3, "big") + bytes([HEADERS, END_HEADERS])

_SETTING = struct.Struct(">HL")
_WINDOW = struct.Struct(">L")
_GOAWAY = struct.Struct(">LL")


class ErrorCode(IntEnum):
    """RFC 9113, 7: why a stream (RST_STREAM) or the connection (GOAWAY) ends."""

    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    size = len(payload)
    return HEADER.pack(size >> 8, size & 0xFF, kind, flags, stream_id) + payload


def settings(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(code, value) for code, value in values.items()))


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    """A SETTINGS payload as (code, value) pairs, in order (its length a multiple of 6: checked by the caller)."""
    return [_SETTING.unpack_from(payload, offset) for offset in range(0, len(payload), 6)]


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _WINDOW.pack(increment))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _WINDOW.pack(code))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, _GOAWAY.pack(last_stream_id, code) + debug)


def ping(data: bytes, *, ack: bool = False) -> bytes:
    return frame(PING, ACK if ack else 0, 0, data)


def u32(payload: bytes, offset: int = 0) -> int:
    """The 32-bit big-endian integer at ``offset`` (a window increment, an error code)."""
    value: int = _WINDOW.unpack_from(payload, offset)[0]
    return value


def header_block(stream_id: int, block: bytes, end_stream: bool, max_frame: int) -> bytes:
    """A header block as HEADERS, then CONTINUATION frames if it does not fit in one frame."""
    first = END_STREAM if end_stream else 0
    if len(block) <= max_frame:
        return frame(HEADERS, first | END_HEADERS, stream_id, block)
    pieces = [block[at:at + max_frame] for at in range(0, len(block), max_frame)]
    out = [frame(HEADERS, first, stream_id, pieces[0])]
    out += [frame(CONTINUATION, 0, stream_id, piece) for piece in pieces[1:-1]]
    out.append(frame(CONTINUATION, END_HEADERS, stream_id, pieces[-1]))
    return b"".join(out)
