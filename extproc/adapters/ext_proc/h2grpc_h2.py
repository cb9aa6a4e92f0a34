"""h2's HTTP/2 connection as the h2grpc transport uses it (h2grpc_connection.py drives it).

Our changes to h2's behaviour (GOAWAY, the open-stream count) and to its
cost per stream (HPACK decoding memoised, the response headers as constant
bytes, no text rendering of received frames), each with why.
"""

from __future__ import annotations

import h2.config
import h2.connection
import h2.errors
import h2.events
from h2.connection import ConnectionInputs
from h2.stream import StreamInputs
from hyperframe.frame import Frame, GoAwayFrame

from extproc.adapters.ext_proc.h2grpc_hpack import MemoDecoder

# Header blocks as bytes, and h2's header checks off: they add about a sixth to the transport's CPU per
# request, and h2 ends the whole connection on a malformed block where a stream error is due. We read
# three headers ourselves and refuse per stream (_start); docs/decisions.md has the measurements.
H2_CONFIG = h2.config.H2Configuration(
    client_side=False, header_encoding=None,
    validate_inbound_headers=False, normalize_inbound_headers=False,
    validate_outbound_headers=False, normalize_outbound_headers=False,
)
RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]
# The same as one HEADERS frame (END_HEADERS) but its stream id: ":status: 200" from HPACK's static table,
# content-type a literal that is not indexed (so the encoder's dynamic table, which h2 owns, is untouched).
_RESPONSE_BLOCK = b"\x88\x0f\x10\x10application/grpc"
_RESPONSE_FRAME = len(_RESPONSE_BLOCK).to_bytes(3, "big") + b"\x01\x04"


def _frame_repr(obj: object) -> str:
    """``repr`` as h2.connection sees it: a frame's is its kind only.

    h2 builds ``repr(frame)`` of every frame it receives for a trace line,
    even when its logger (ours: h2's no-op default) writes nothing: 1 to 3 µs
    a frame, four frames a request. That trace line is h2.connection's only
    use of ``repr``.
    """
    return f"<{type(obj).__name__}>" if isinstance(obj, Frame) else repr(obj)


vars(h2.connection)["repr"] = _frame_repr  # a module global shadowing the builtin, for h2.connection alone


class H2Connection(h2.connection.H2Connection):
    """h2's connection, with GOAWAY as a message instead of the end, without its walk per new stream, and
    with header blocks a peer repeats decoded once (h2grpc_hpack.py).

    h2 takes a GOAWAY, sent or received, as the connection's end: it then
    refuses to send anything, so every stream still running would fail. HTTP/2
    means it as "no new streams": here it is only a frame, and the connection
    decides (h2grpc ends once the last stream has).

    h2 also counts the open streams on each new inbound stream, walking them
    all: with thousands held that made a burst quadratic (7 s of CPU for 10,000
    streams on one connection, 39 s for 20,000). The count is ours (the calls
    of the connection, against advanced.grpc.max_streams_per_connection); the walk,
    which also forgets closed streams, runs once per half as many new streams
    as it covers: amortized constant per stream.
    """

    _since_walk = 0

    def __init__(self, config: h2.config.H2Configuration) -> None:
        super().__init__(config)
        self.decoder = MemoDecoder(self.decoder.max_header_list_size, self.decoder.max_allowed_table_size)

    @property
    def open_inbound_streams(self) -> int:
        self._since_walk += 1
        if self._since_walk * 2 >= len(self.streams):
            self._since_walk = 0
            _ = super().open_inbound_streams  # forgets the closed streams
        return 0  # never over h2's limit: Connection refuses past its own

    def send_response_headers(self, stream_id: int) -> None:
        """Our response headers on a stream, as ``send_headers(stream_id, RESPONSE_HEADERS)`` sends them, for less.

        h2's way builds and encodes them again for every stream (utf-8 checks,
        a frame object, HPACK, about 35 µs); here the frame is constant bytes.
        The connection's and the stream's state machines still take the step
        (so a stream reset meanwhile raises the same ProtocolError), and a
        stream h2 does not know goes to h2, which says why.
        """
        stream = self.streams.get(stream_id)
        if stream is None:
            self.send_headers(stream_id, RESPONSE_HEADERS)
            return
        self.state_machine.process_input(ConnectionInputs.SEND_HEADERS)
        stream.state_machine.process_input(StreamInputs.SEND_HEADERS)
        self._data_to_send += _RESPONSE_FRAME + stream_id.to_bytes(4, "big") + _RESPONSE_BLOCK

    def _receive_goaway_frame(self, frame: GoAwayFrame) -> tuple[list[Frame], list[h2.events.Event]]:
        event = h2.events.ConnectionTerminated()
        try:
            event.error_code = h2.errors.ErrorCodes(frame.error_code)
        except ValueError:
            event.error_code = frame.error_code
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]

    def send_goaway(self, last_stream_id: int, error_code: int = 0, reason: bytes = b"") -> None:
        self._prepare_for_sending([GoAwayFrame(0, last_stream_id=last_stream_id, error_code=error_code,
                                               additional_data=reason)])

