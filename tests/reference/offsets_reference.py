"""Independent NumPy model of the compact code of kept offsets in chunks (DeMo's and
SparseLoCo's messages), written from its description, not from jaxcomm's code.

A chunk of ``L`` elements keeps ``k``; its offsets travel in the shortest of three fixed-size
codes (a tie goes to the first):

1. ``k`` fields of ``ceil(log2 L)`` bits, least significant bit first, in the order given;
2. an ``L``-bit mask, bit ``x`` set for each kept offset ``x``;
3. Elias-Fano of the ascending offsets ``x_0 < ... < x_{k-1}``: with ``l = floor(log2(L / k))``,
   the ``k`` low parts ``x_i mod 2^l`` as ``l``-bit fields, then a vector of ``k + floor((L -
   1) / 2^l) + 1`` bits with bit ``floor(x_i / 2^l) + i`` set.

Codes 2 and 3 carry no order: the values then travel in ascending offset order. All chunks'
bits form one stream, packed little-endian (bit ``i`` in bit ``i % 8`` of byte ``i // 8``).
"""

from __future__ import annotations

import numpy as np


def _fields(v: np.ndarray, nbits: int) -> np.ndarray:
    return ((np.asarray(v).reshape(-1, 1) >> np.arange(nbits)) & 1).astype(np.uint8).reshape(-1)


def chunk_codes(offsets: np.ndarray, length: int) -> list[np.ndarray]:
    """The three codes' bits of one chunk's kept ``offsets`` ``(k,)``."""
    k = len(offsets)
    width = int(np.ceil(np.log2(length))) if length > 1 else 0
    mask = np.zeros(length, np.uint8)
    mask[offsets] = 1
    low = int(np.floor(np.log2(length / k)))
    ascending = np.sort(offsets)
    upper = np.zeros(k + (length - 1) // 2**low + 1, np.uint8)
    upper[ascending // 2**low + np.arange(k)] = 1
    elias_fano = np.concatenate([_fields(ascending % 2**low, low), upper])
    return [_fields(offsets, width), mask, elias_fano]


def offset_bits(length: int, k: int) -> int:
    """Bits of one chunk's offsets: the shortest code's length."""
    return min(len(c) for c in chunk_codes(np.arange(k), length))


def offset_stream(idx: np.ndarray, length: int) -> np.ndarray:
    """The packed bytes of the offsets of every chunk, ``idx`` ``(chunks, k)``."""
    pick = int(np.argmin([len(c) for c in chunk_codes(idx[0], length)]))
    stream = np.concatenate([chunk_codes(row, length)[pick] for row in idx])
    return np.packbits(stream, bitorder="little")


def value_order(idx: np.ndarray, length: int) -> np.ndarray:
    """The order the kept values of each chunk travel in: as given when the fields code is the
    shortest, ascending offsets otherwise."""
    lengths = [len(c) for c in chunk_codes(idx[0], length)]
    return idx if int(np.argmin(lengths)) == 0 else np.sort(idx, axis=1)
