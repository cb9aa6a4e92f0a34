"""What one connection of the builtin transport may cost: read only while its peer keeps up, ended past a limit.

The base of builtin/connection.py's Connection, apart so that its bounds read
together. Reading pauses for two reasons: our output waits on the peer (more
than ``advanced.grpc.output_buffer_bytes`` unread: the transport calls
pause_writing), or the rest of a read waits for the next loop cycle (past
``max_frames_per_read``, builtin/flood.py), so that no connection holds the
loop for more than its share. The connection ends, with GOAWAY
ENHANCE_YOUR_CALM and one warning naming the limit, past the HTTP/2 layer's
counts (builtin/flood.py), past ``max_output_buffer_bytes`` or the frame
counts of what the peer left unread, or once the streams the peer reset
prematurely are half of its streams (Envoy's rule for CVE-2023-44487's
rapid reset; premature: before its handler took a message, within
``premature_reset_min_stream_lifetime_s`` of opening).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import time

from extproc.adapters.config import GrpcLimits
from extproc.adapters.grpc.builtin import http2
from extproc.adapters.grpc.builtin.frames import ErrorCode
from extproc.adapters.grpc.builtin.http2 import Http2Connection
from extproc.adapters.grpc.peer_warnings import PeerWarnings

# Why reading is paused: our output waits on the peer, or the rest of a read waits for the next loop cycle.
OUTPUT, INPUT = 1, 2
# After ending a connection for abuse, the C allocator is asked to give back what it freed: at most this often.
TRIM_EVERY_S = 0.1


def _malloc_trim() -> object:
    """glibc's malloc_trim, or None elsewhere (macOS, musl): freed memory is kept by the allocator until asked."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None)
    except OSError:
        return None


_TRIM = _malloc_trim()


class _GiveBack:
    """Return the memory freed with abusive connections to the system, at most once per TRIM_EVERY_S.

    What an attack made us allocate is freed once its connection ends and its
    calls' tasks have run their cancellation, but glibc keeps large freed
    blocks in its heap for reuse: the process stayed tens of MB larger after
    each flood of replies nobody read. malloc_trim returns the free pages
    (1-2 ms), a little after the end; a stream of abusive connections gets
    one a second.
    """

    def __init__(self) -> None:
        self.last = float("-inf")
        self.scheduled = False

    def soon(self, loop: asyncio.AbstractEventLoop) -> None:
        if _TRIM is None or self.scheduled:
            return
        self.scheduled = True
        loop.call_later(max(0.01, self.last + TRIM_EVERY_S - time.monotonic()), self._trim)

    def _trim(self) -> None:
        self.scheduled = False
        self.last = time.monotonic()
        _TRIM(0)  # type: ignore[operator]


GIVE_BACK = _GiveBack()


class Bounded(asyncio.Protocol):
    """A connection's transport and HTTP/2 state, with what bounds them."""

    def __init__(self, grpc: GrpcLimits, h2: Http2Connection, warnings: PeerWarnings) -> None:
        self._grpc = grpc
        self._h2 = h2
        self._warnings = warnings
        self._loop = asyncio.get_running_loop()  # made by the listener, in its loop
        self._transport: asyncio.Transport | None = None
        self._peer: object = None
        self._ended = False  # past a limit, or broken: nothing more is read, nothing written but the GOAWAY
        self._paused = 0  # why reading is paused (OUTPUT, INPUT), if it is
        self._closed_calls = 0  # calls ended on this connection, however
        self._premature = 0  # calls the peer reset before their handler took a message, soon after opening
        self._waiting = 0  # reply bytes waiting on the peer's windows (or on our output): Connection's _park
        self._cycle_work = -1  # max_frames_per_read spent in this loop cycle's reads; -1: none yet
        self.writes = 0  # socket writes made: a loop cycle's replies, of every stream, leave in one

    # -- the connection's state, read-only: what an operator looks at to see a peer that does not keep up --------

    @property
    def reading_paused(self) -> bool:
        """Whether reading from the peer is paused: it left our output unread, or a read waits for the next cycle."""
        return self._paused != 0

    @property
    def unread_bytes(self) -> int:
        """Bytes written to the socket that the peer has not taken yet (0 once the connection is lost)."""
        return 0 if self._transport is None else self._transport.get_write_buffer_size()

    @property
    def waiting_bytes(self) -> int:
        """Reply bytes waiting on the peer's windows (or on our output); with ``unread_bytes``, within
        ``max_output_buffer_bytes``."""
        return self._waiting

    @property
    def open_streams(self) -> int:
        """Streams the HTTP/2 layer keeps state for: the open ones (a stream's state goes once it closes)."""
        return len(self._h2.streams)

    def pause_writing(self) -> None:
        """The peer has not taken output_buffer_bytes of ours: read nothing more from it until it does."""
        self._pause(OUTPUT)

    def resume_writing(self) -> None:
        self._resume(OUTPUT)

    def _pause(self, reason: int) -> None:
        if not self._paused and self._transport is not None:
            self._transport.pause_reading()
        self._paused |= reason

    def _resume(self, reason: int) -> None:
        self._paused &= ~reason
        if not self._paused and self._transport is not None and not self._ended:
            self._transport.resume_reading()

    def _read(self, data: bytes) -> list[http2.Event]:
        """The events of ``data``, within what is left of this loop cycle's max_frames_per_read (a cycle may
        bring up to 32 reads: libuv reads a socket until it is empty)."""
        if self._cycle_work < 0:
            self._cycle_work = 0
            self._loop.call_soon(self._new_cycle)
        events = self._h2.receive_data(data, self._cycle_work)
        self._cycle_work = self._h2.work
        return events

    def _new_cycle(self) -> None:
        self._cycle_work = -1

    def _more_later(self) -> None:
        """The HTTP/2 layer cut a read at max_frames_per_read: the rest a loop cycle later, reading paused meanwhile."""
        self._pause(INPUT)
        self._loop.call_soon(self._more_input)

    def _more_input(self) -> None:
        self._paused &= ~INPUT
        self.data_received(b"")
        self._resume(0)

    def _premature_reset(self, born: float, now: float) -> bool:
        """The peer reset a call born at ``born`` (0: its handler took a message): True if that ended the connection."""
        if not born or now - born >= self._grpc.premature_reset_min_stream_lifetime_s:
            return False
        self._premature += 1
        if 2 * self._premature < max(self._closed_calls, self._grpc.premature_reset_total_stream_count):
            return False
        self._flood(f"{self._premature} of {self._closed_calls} streams reset by the peer before their first "
                    "message was read (past advanced.grpc.premature_reset_total_stream_count)")
        return True

    def _output_check(self, size: int) -> None:
        """``size`` bytes were just written (or a reply was parked): what the peer leaves untaken, in its socket
        and in replies waiting on its windows (``_waiting``), is checked against the limits."""
        if self._transport is None or self._ended:
            return
        unread = self._transport.get_write_buffer_size()
        over = self._h2.written(size, unread) if size else None
        if unread + self._waiting > self._grpc.max_output_buffer_bytes:
            over = "max_output_buffer_bytes"
        if over is not None:
            self._flood(f"{unread} bytes the peer did not read and {self._waiting} waiting on its windows "
                        f"({self._h2.outbound_frames} frames, {self._h2.outbound_control_frames} PING, SETTINGS "
                        f"or RST_STREAM; past advanced.grpc.{over})")

    def _flood(self, message: str, *, queued: bool = False) -> None:
        """Past a limit: one warning, GOAWAY ENHANCE_YOUR_CALM (``queued`` already by the HTTP/2 layer), the end."""
        self._warnings.warn(self._peer, "connection ended: %s", message)
        if not queued:
            self._h2.send_goaway(self._h2.highest_inbound_stream_id, ErrorCode.ENHANCE_YOUR_CALM)
        self._end()
        GIVE_BACK.soon(self._loop)

    def _end(self) -> None:
        """Write what is queued (a GOAWAY), then close; abort instead if the peer leaves it unread.

        A close waits until the peer has read everything: one that never reads
        would keep the connection, and all it did not read, for ever.
        """
        self._ended = True
        transport = self._transport
        if transport is None:
            return
        data = self._h2.data_to_send()
        if data:
            transport.write(data)
            self.writes += 1
        if transport.get_write_buffer_size():
            transport.abort()
        else:
            transport.close()
