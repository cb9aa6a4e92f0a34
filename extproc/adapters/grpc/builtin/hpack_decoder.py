"""HPACK for the builtin transport: decoding memoised per header block while the dynamic table is unchanged,
and hpack's debug lines muted.

Envoy opens every ext_proc stream with the same header block, byte for byte,
once its headers are in the table: seven indexed fields and ``:path`` as a
Huffman-coded literal that is not indexed. hpack decodes it in pure Python,
about 30 µs a stream. A block's meaning depends only on its bytes, the
decoder's dynamic table and two limits; so while none of them changed, a
block seen before decodes to what it did then. The table counts its changes
(a generation): every entry added, every resize (a block carrying either is
never memoised, and makes the memo stale).

hpack logs a debug line for most integers and headers it encodes or decodes;
with DEBUG off, each call still costs a level check (23 a stream measured).
``mute_debug`` swaps its loggers for one whose ``debug`` does nothing, unless
DEBUG is on for them when the transport starts (setup_logging never turns it
on for libraries, adapters/logs.py).
"""

from __future__ import annotations

import logging
from typing import Any

import hpack.hpack
import hpack.table
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
            return list(found)  # the caller's to keep or change: the memo keeps its own
        headers = list(super().decode(data, raw))
        if table.generation == state[0] and len(key[0]) <= MAX_BLOCK_BYTES:  # the block changed nothing
            if len(self._memo) >= MAX_BLOCKS:
                self._memo.clear()
            self._memo[key] = list(headers)
        return headers


class _NoDebug(logging.Logger):
    """A logger whose debug lines cost one call: hpack writes nothing else."""

    def debug(self, msg: object, *args: Any, **kwargs: Any) -> None:
        pass


def mute_debug() -> None:
    """Mute hpack's debug lines, unless DEBUG is on for them now (then they are kept: someone asked for them)."""
    hpack.hpack.log = _muted(hpack.hpack.log)
    hpack.table.log = _muted(hpack.table.log)


def _muted(logger: logging.Logger) -> logging.Logger:
    if isinstance(logger, _NoDebug) or logger.isEnabledFor(logging.DEBUG):
        return logger
    return _NoDebug(logger.name)
