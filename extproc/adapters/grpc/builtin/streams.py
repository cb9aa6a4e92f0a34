"""The streams of builtin/http2.py's connection: an open one's record, a closed one's memory, windows given back.

Apart so that what RFC 9113 (5.1) says of a frame on a closed stream reads in
one place, as the conformance test against the ``h2`` library found it
(tests/adapters/grpc/test_h2grpc_conformance.py): it depends on how the stream closed.
"""

from __future__ import annotations

from typing import NoReturn

from extproc.adapters.grpc.builtin.frames import ErrorCode

# Closed streams are remembered with how they closed, the last 1,024 (60 KB at most): by our RST_STREAM (a
# frame the peer sent before it read it is ignored), by the peer's (any frame but PRIORITY is then a stream
# error STREAM_CLOSED), or by both ends (a connection error STREAM_CLOSED). On a stream forgotten or never
# opened (skipped: closed by a higher one, 5.1.1), HEADERS is a connection error PROTOCOL_ERROR and any other
# frame a stream error STREAM_CLOSED, as h2 answers them.
REMEMBERED_RESETS = 1024
BY_US, BY_PEER, ENDED_BOTH = 0, 1, 2


class Stream:
    """An open stream: its windows both ways, and which halves are still open."""

    __slots__ = ("send_window", "recv_window", "processed", "remote_open", "local_open")

    def __init__(self, send_window: int, recv_window: int, remote_open: bool) -> None:
        self.send_window = send_window  # what we may still send
        self.recv_window = recv_window  # what the peer may still send
        self.processed = 0  # bytes the handler took that the peer was not given back yet
        self.remote_open = remote_open
        self.local_open = True


def window_increment(window: int, processed: int, largest: int) -> int:
    """How much window to give back, by h2's rule (the peer sees the same updates): once half the window's
    worth is processed, or the window is shut and over 1 KB is (few updates, a stream never left blocked)."""
    if processed >= largest // 2 or (window == 0 and processed > min(1024, largest // 4)):
        return min(processed, largest - window)
    return 0


class ClosedStreams:
    """The memory of closed streams (mixed into Http2Connection)."""

    def __init__(self) -> None:
        self._closed: dict[int, int] = {}  # stream id -> how it closed (BY_US, BY_PEER, ENDED_BOTH), oldest first

    def _fail(self, code: ErrorCode, message: str) -> NoReturn:
        raise NotImplementedError  # Http2Connection's: GOAWAY queued, Http2Error raised

    def _remember(self, stream_id: int, how: int) -> None:
        closed = self._closed
        closed[stream_id] = how
        if len(closed) > REMEMBERED_RESETS:
            del closed[next(iter(closed))]

    def _closed_error(self, stream_id: int, *, headers: bool) -> bool:
        """A frame on a closed stream: True for a stream error STREAM_CLOSED, False to ignore it; or the end."""
        how = self._closed.get(stream_id)
        if how == ENDED_BOTH or (how is None and headers):
            self._fail(ErrorCode.STREAM_CLOSED if how == ENDED_BOTH else ErrorCode.PROTOCOL_ERROR,
                       f"{'HEADERS' if headers else 'a frame'} on stream {stream_id}, closed or never opened")
        return how != BY_US
