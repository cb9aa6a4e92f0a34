"""HPACK decoding for the h2grpc transport, memoised per header block while the dynamic table is unchanged.

Envoy opens every ext_proc stream with the same header block, byte for byte,
once its headers are in the table: seven indexed fields and ``:path`` as a
Huffman-coded literal that is not indexed. hpack decodes it in pure Python,
about 30 µs a stream. A block's meaning depends only on its bytes, the
decoder's dynamic table and two limits; so while none of them changed, a
block seen before decodes to what it did then. The table counts its changes
(a generation): every entry added, every resize (a block carrying either is
never memoised, and makes the memo stale).
"""

from __future__ import annotations

from hpack import Decoder
from hpack.struct import HeaderTuple
from hpack.table import HeaderTable

# A few blocks, short ones: what a client repeats. A peer sending ever new blocks only replaces them.
MAX_BLOCKS = 8
MAX_BLOCK_BYTES = 1024


class _CountedTable(HeaderTable):
    """The decoder's dynamic table, counting its changes."""

    generation = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.generation += 1
        super().add(name, value)

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @maxsize.setter
    def maxsize(self, newmax: int) -> None:
        self.generation += 1
        HeaderTable.maxsize.fset(self, newmax)  # type: ignore[attr-defined]


class MemoDecoder(Decoder):
    """hpack's decoder, answering a block seen before from memory while the table and limits are as they were."""

    def __init__(self, max_header_list_size: int, max_allowed_table_size: int) -> None:
        super().__init__(max_header_list_size)
        self._table = self.header_table = _CountedTable()
        self.max_allowed_table_size = max_allowed_table_size
        self._memo: dict[tuple[bytes, bool], list[HeaderTuple]] = {}
        self._valid_for: tuple[int, int, int] = (-1, 0, 0)  # (generation, max_header_list_size, max_allowed_table_size)

    def decode(self, data: bytes, raw: bool = False) -> list[HeaderTuple]:
        table = self._table
        state = (table.generation, self.max_header_list_size, self.max_allowed_table_size)
        if state != self._valid_for:
            self._memo.clear()
            self._valid_for = state
        key = (bytes(data), raw)
        found = self._memo.get(key)
        if found is not None:
            return list(found)  # h2 hands the list on in an event: the memo keeps its own
        headers = list(super().decode(data, raw))
        if table.generation == state[0] and len(key[0]) <= MAX_BLOCK_BYTES:  # the block changed nothing
            if len(self._memo) >= MAX_BLOCKS:
                self._memo.clear()
            self._memo[key] = list(headers)
        return headers
