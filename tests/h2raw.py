"""A bare HTTP/2 client (h2's state machine on an asyncio socket), for what no gRPC client sends.

tests/adapters/grpc/test_h2grpc_abuse.py attacks the ext_proc transport with it: bad
messages, GOAWAYs, streams past the limits, non-gRPC requests, frames in
bulk. It records every event per stream so a test asserts what the peer saw.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import h2.config
import h2.connection
import h2.events
from hyperframe.frame import Frame, GoAwayFrame


class _Unlimited(h2.connection.H2Connection):
    """A client that opens streams past the server's advertised limit (and without h2's walk per stream).

    It also reads on after a GOAWAY (h2 would refuse every later frame), to see the streams finish.
    """

    @property
    def open_outbound_streams(self) -> int:
        return 0

    def _receive_goaway_frame(self, frame: GoAwayFrame) -> tuple[list[Frame], list[h2.events.Event]]:
        event = h2.events.ConnectionTerminated()
        event.error_code = frame.error_code
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]


def message(payload: bytes) -> bytes:
    """One gRPC length-prefixed, uncompressed message."""
    return b"\0" + len(payload).to_bytes(4, "big") + payload


class RawClient:
    def __init__(self) -> None:
        self.h2 = _Unlimited(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.events: list[h2.events.Event] = []
        self.eof = False
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, port: int, *, preface: bool = True) -> RawClient:
        client = cls()
        client._reader, client._writer = await asyncio.open_connection("127.0.0.1", port)
        if preface:
            client.h2.initiate_connection()
            client.flush()
        client._task = asyncio.ensure_future(client._read())
        return client

    async def _read(self) -> None:
        assert self._reader is not None
        try:
            while data := await self._reader.read(65_536):
                for event in self.h2.receive_data(data):
                    self.events.append(event)
                    if isinstance(event, h2.events.DataReceived) and event.flow_controlled_length:
                        self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                self.flush()
        except ConnectionError:  # the server closed while we wrote: as good as an end
            pass
        finally:
            self.eof = True

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.write(data)

    def write(self, data: bytes) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(data)

    def request(self, path: bytes, *, content_type: bytes | None = b"application/grpc", method: bytes = b"POST",
                end: bool = False) -> int:
        stream_id = self.h2.get_next_available_stream_id()
        headers = [(b":method", method), (b":scheme", b"http"), (b":path", path), (b":authority", b"test")]
        if content_type is not None:
            headers.append((b"content-type", content_type))
        self.h2.send_headers(stream_id, [*headers, (b"te", b"trailers")], end_stream=end)
        self.flush()
        return stream_id

    def send(self, stream_id: int, data: bytes, *, end: bool = False) -> None:
        """Send ``data`` in frames (h2 refuses more than the window: then call send_within_window)."""
        size = self.h2.max_outbound_frame_size
        for start in range(0, max(len(data), 1), size):
            chunk = data[start:start + size]
            self.h2.send_data(stream_id, chunk, end_stream=end and start + size >= len(data))
        self.flush()

    def send_within_window(self, stream_id: int, data: bytes) -> bytes:
        """Send as much of ``data`` as the windows let out now; the rest is returned."""
        while data:
            size = min(len(data), self.h2.local_flow_control_window(stream_id), self.h2.max_outbound_frame_size)
            if size <= 0:
                break
            self.h2.send_data(stream_id, data[:size])
            data = data[size:]
        self.flush()
        return data

    def goaway(self, error_code: int = 0) -> None:
        """A GOAWAY as bytes, so that our own h2 still takes the server's frames after it."""
        self.write(GoAwayFrame(0, last_stream_id=0, error_code=error_code).serialize())

    async def until(self, done: Callable[[], bool], timeout: float = 5.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not done():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("the server did not answer in time")
            await asyncio.sleep(0.005)

    def of(self, stream_id: int) -> list[h2.events.Event]:
        return [e for e in self.events if getattr(e, "stream_id", None) == stream_id]

    def headers(self, stream_id: int) -> dict[bytes, bytes]:
        """The stream's response headers and trailers, merged."""
        merged: dict[bytes, bytes] = {}
        for event in self.of(stream_id):
            if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                merged.update(dict(event.headers or ()))
        return merged

    def status(self, stream_id: int) -> int | None:
        value = self.headers(stream_id).get(b"grpc-status")
        return None if value is None else int(value)

    def ended(self, stream_id: int) -> bool:
        return any(isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset)) for e in self.of(stream_id))

    def reset_code(self, stream_id: int) -> Any:
        return next((e.error_code for e in self.of(stream_id) if isinstance(e, h2.events.StreamReset)), None)

    def goaways(self) -> list[h2.events.ConnectionTerminated]:
        return [e for e in self.events if isinstance(e, h2.events.ConnectionTerminated)]

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
