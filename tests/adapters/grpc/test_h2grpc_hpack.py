"""The h2grpc transport's HPACK decoder: a block repeated while nothing changed is answered from memory, and
every change of the dynamic table or of the limits makes it decode again, as hpack's own decoder would;
hpack's debug lines muted unless asked for.

Each test feeds the same sequence of blocks to hpack's decoder and to ours and
asserts the same headers, or the same error, block by block.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import hpack
import hpack.hpack
import hpack.table
import pytest
from hpack import Decoder, Encoder
from hpack.struct import HeaderTuple

from extproc.adapters.grpc.builtin.hpack_decoder import MemoDecoder, mute_debug

pytestmark = pytest.mark.unit

LIMIT = 2**16
TABLE = 4096
# Envoy's block once its headers are indexed: indexed fields and :path, Huffman-coded, not indexed.
PATH = (b":path", b"/envoy.service.ext_proc.v3.ExternalProcessor/Process")


def _pair() -> tuple[Decoder, MemoDecoder]:
    return Decoder(LIMIT), MemoDecoder(LIMIT, TABLE)


def _same(plain: Decoder, memo: MemoDecoder, block: bytes) -> Sequence[tuple[bytes, bytes]]:
    expected = list(plain.decode(block, raw=True))
    got = memo.decode(block, raw=True)
    assert got == expected
    return got


def test_a_repeated_block_is_decoded_once_while_the_table_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = Encoder()
    plain, memo = _pair()
    _same(plain, memo, encoder.encode([(b":method", b"POST"), (b"x-envoy-internal", b"true")]))  # indexes it
    block = encoder.encode([(b":method", b"POST"), (b"x-envoy-internal", b"true"), (PATH[0], PATH[1], True)])
    first = _same(plain, memo, block)
    assert first[-1] == PATH

    def no_decoding(*_: object) -> None:
        raise AssertionError("decoded again")

    monkeypatch.setattr(hpack.Decoder, "decode", no_decoding)  # what MemoDecoder calls on a block it has not seen
    again = memo.decode(block, raw=True)
    assert again == first
    again.append(HeaderTuple(b"x", b"y"))  # what a caller does with its list does not reach the memo
    assert memo.decode(block, raw=True) == first


def test_an_entry_added_to_the_table_makes_the_same_bytes_decode_to_what_they_now_mean() -> None:
    encoder = Encoder()
    plain, memo = _pair()
    _same(plain, memo, encoder.encode([(b"x-a", b"1")]))  # x-a at index 62
    indexed = encoder.encode([(b"x-a", b"1")])
    assert _same(plain, memo, indexed) == [(b"x-a", b"1")]
    _same(plain, memo, encoder.encode([(b"x-b", b"2")]))  # x-b at 62 now, x-a at 63
    assert _same(plain, memo, indexed) == [(b"x-b", b"2")]


def test_a_table_resize_and_lowered_limits_are_not_answered_from_memory() -> None:
    encoder = Encoder()
    plain, memo = _pair()
    _same(plain, memo, encoder.encode([(b"x-a", b"1")]))
    indexed = encoder.encode([(b"x-a", b"1")])
    _same(plain, memo, indexed)
    for decoder in (plain, memo):  # a size update to 0 empties the dynamic table: index 62 is gone
        decoder.decode(b"\x20", raw=True)
        with pytest.raises(hpack.InvalidTableIndex):
            decoder.decode(indexed, raw=True)

    static = Encoder().encode([(b":method", b"POST"), (b"x-long", b"v" * 100, True)])
    assert _same(plain, memo, static)[1] == (b"x-long", b"v" * 100)
    for decoder in (plain, memo):
        decoder.max_header_list_size = 100
        with pytest.raises(hpack.OversizedHeaderListError):
            decoder.decode(static, raw=True)
        decoder.max_header_list_size = LIMIT
        decoder.header_table_size = 4096
        decoder.max_allowed_table_size = 1024
        with pytest.raises(hpack.InvalidTableSizeError):
            decoder.decode(static, raw=True)


@pytest.fixture
def hpack_loggers(monkeypatch: pytest.MonkeyPatch) -> None:
    """hpack's own loggers for the test (a server started earlier in this process may have muted them), restored after."""
    monkeypatch.setattr(hpack.hpack, "log", logging.getLogger("hpack.hpack"))
    monkeypatch.setattr(hpack.table, "log", logging.getLogger("hpack.table"))


def test_hpack_debug_lines_are_muted_unless_debug_is_on_for_them(
        hpack_loggers: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="hpack")
    mute_debug()
    Decoder().decode(Encoder().encode([(b"x-a", b"1")]))
    assert any(r.name == "hpack.hpack" for r in caplog.records)  # asked for: kept

    caplog.set_level(logging.INFO, logger="hpack")
    caplog.clear()
    mute_debug()
    mute_debug()  # idempotent
    caplog.set_level(logging.DEBUG, logger="hpack")  # too late: muted for good once the transport started
    assert Decoder().decode(Encoder().encode([(b"x-a", b"1")]), raw=True) == [(b"x-a", b"1")]
    assert not [r for r in caplog.records if r.name.startswith("hpack")]
