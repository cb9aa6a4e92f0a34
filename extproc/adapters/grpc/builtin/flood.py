"""What a peer may make one HTTP/2 connection send, or read for nothing: counted as Envoy's codec counts it.

A frame that obliges an answer (PING, SETTINGS, a frame that earns a
RST_STREAM) costs the peer 9 to 17 bytes and us an answer queued until the
peer reads it; a frame that carries nothing (an empty DATA, HEADERS or
CONTINUATION without END_STREAM, a PRIORITY, a WINDOW_UPDATE nobody needs)
costs us a parse for nothing. Every maintained HTTP/2 server counts them
(the CVE-2019-9511..9518 family) and ends a connection past a bound with
GOAWAY ENHANCE_YOUR_CALM. These are Envoy's counters, with its names and
defaults (``Http2ProtocolOptions`` in envoy/config/core/v3/protocol.proto;
``ProtocolConstraints`` in source/common/http/http2/protocol_constraints.cc):

- frames queued for the peer and not yet taken by its socket
  (``max_outbound_frames``), and the PING, SETTINGS and RST_STREAM among
  them (``max_outbound_control_frames``). Envoy counts each frame out as
  its bytes leave; an asyncio transport says only how many bytes wait, so
  after each write the counts are scaled to the share of the bytes still
  waiting (exact for a flood of one frame type), and are zero once the
  socket took everything. Control frames the peer's frames induce are
  checked as they are queued, the rest after each write;
- consecutive frames with an empty payload and no END_STREAM
  (``max_consecutive_inbound_frames_with_empty_payload``);
- PRIORITY frames, over ``max_inbound_priority_frames_per_stream`` × (1 +
  header blocks received);
- WINDOW_UPDATE frames, over 1 + 2 × (header blocks received +
  ``max_inbound_window_update_frames_per_data_frame_sent`` × DATA frames sent);
- CONTINUATION frames per header block (``max_continuation_frames``,
  nghttp2's ``NGHTTP2_DEFAULT_MAX_CONTINUATIONS``; CVE-2024-27316).

And one that does not end anything: the frames handled per read of the
socket (``max_frames_per_read``; DATA counting one more per KiB, a header
block one per field and 16 for its stream), past which the rest of the read
waits for the next loop cycle, the connection's reading paused meanwhile.
A loop cycle reads up to 8 MiB from a socket (libuv reads 32 times), a
read thousands of streams' headers: handled at once, they held every other
connection's requests for a tenth of a second. grpcio's C-core cuts a read
at 32 new streams (``grpc.http2.max_requests_per_read``), Envoy offers it
as ``http.max_requests_per_io_cycle``.

Counting is a few integer operations on the frames that carry the counts;
the DATA and HEADERS of a request pay one store each.
"""

from __future__ import annotations

from typing import NoReturn

from extproc.adapters.config import GrpcLimits
from extproc.adapters.grpc.builtin.frames import ErrorCode

# The key that names each limit in the log line and the GOAWAY's reason.
KEY = "advanced.grpc."
DEFAULT_LIMITS = GrpcLimits()


class FloodCounts:
    """The counters of one connection, and the checks that end it past a limit (mixed into Http2Connection)."""

    def __init__(self, limits: GrpcLimits) -> None:
        self.outbound_frames = 0  # frames queued since the peer last took everything
        self.outbound_control_frames = 0  # PING, SETTINGS and RST_STREAM among them
        self._outbound_bytes = 0  # the bytes those frames were, as far as they still wait in the socket
        self._max_frames = limits.max_outbound_frames
        self._max_control = limits.max_outbound_control_frames
        self._max_empty = limits.max_consecutive_inbound_frames_with_empty_payload
        self._max_priority = limits.max_inbound_priority_frames_per_stream
        self._max_updates = limits.max_inbound_window_update_frames_per_data_frame_sent
        self._max_continuations = limits.max_continuation_frames
        self.continuations = 0  # the CONTINUATION frames of the header block being received
        self._empty = 0  # consecutive frames with an empty payload and no END_STREAM
        self.header_blocks = 0  # header blocks received (Envoy's inbound streams)
        self._priorities = 0
        self._updates = 0
        self.data_frames_sent = 0
        self.max_work = limits.max_frames_per_read
        self.work = 0  # frames read in this loop cycle, a header block counting more (builtin/http2.py)

    def _fail(self, code: ErrorCode, message: str) -> NoReturn:
        raise NotImplementedError  # Http2Connection's: GOAWAY queued, Http2Error raised

    def flood(self, limit: str, what: str) -> NoReturn:
        """Past ``limit``: the connection ends with GOAWAY ENHANCE_YOUR_CALM, its error naming the limit."""
        self._fail(ErrorCode.ENHANCE_YOUR_CALM, f"{what} (past {KEY}{limit})")

    def written(self, size: int, waiting: int) -> str | None:
        """``size`` bytes were handed to the socket and ``waiting`` of all it was given still wait: the limit
        now exceeded by the frames still queued (their counts scaled to the bytes that wait), if any."""
        if not waiting:
            self.outbound_frames = self.outbound_control_frames = self._outbound_bytes = 0
            return None
        total = self._outbound_bytes + size
        self.outbound_frames = self.outbound_frames * waiting // total
        self.outbound_control_frames = self.outbound_control_frames * waiting // total
        self._outbound_bytes = waiting
        if self.outbound_frames > self._max_frames:
            return "max_outbound_frames"
        if self.outbound_control_frames > self._max_control:
            return "max_outbound_control_frames"
        return None

    def control_frame(self) -> None:
        """A PING ACK, SETTINGS ACK or RST_STREAM queued: past the limit while the peer does not read, the end."""
        self.outbound_frames += 1
        self.outbound_control_frames += 1
        if self.outbound_control_frames > self._max_control:
            self.flood("max_outbound_control_frames",
                       f"{self.outbound_control_frames} PING, SETTINGS and RST_STREAM frames the peer did not read")

    def own_control_frame(self) -> None:
        """A RST_STREAM of our own queued: counted, and checked once written (builtin/bounds.py)."""
        self.outbound_frames += 1
        self.outbound_control_frames += 1

    def payload(self, carried: object, size: int = 0) -> None:
        """A DATA, HEADERS or CONTINUATION frame: ``carried`` false if it had an empty payload and no END_STREAM;
        ``size``, a DATA frame's, counts a frame of max_frames_per_read per KiB."""
        if carried:
            self._empty = 0
            self.work += size >> 10
            return
        self._empty += 1
        if self._empty > self._max_empty:
            self.flood("max_consecutive_inbound_frames_with_empty_payload",
                       f"{self._empty} consecutive frames with an empty payload")

    def continuation_frame(self, payload: bytes) -> None:
        self.payload(payload)
        self.continuations += 1
        if self.continuations > self._max_continuations:
            self.flood("max_continuation_frames", f"a header block in over {self._max_continuations} CONTINUATIONs")

    def priority_frame(self) -> None:
        self._priorities += 1
        if self._priorities > self._max_priority * (1 + self.header_blocks):
            self.flood("max_inbound_priority_frames_per_stream",
                       f"{self._priorities} PRIORITY frames for {self.header_blocks} header blocks")

    def window_update_frame(self) -> None:
        self._updates += 1
        if self._updates > 1 + 2 * (self.header_blocks + self._max_updates * self.data_frames_sent):
            self.flood("max_inbound_window_update_frames_per_data_frame_sent",
                       f"{self._updates} WINDOW_UPDATE frames for {self.data_frames_sent} DATA frames sent")
