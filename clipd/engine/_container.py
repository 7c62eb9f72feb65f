"""The one container format of the blobs clipd writes: checkpoints (``PartialState``) and private releases.

Layout, little-endian::

    magic (8 bytes: what the blob holds)  header length (uint64)  header (JSON)  arrays  CRC-32 (uint32)

The header is the caller's fields plus ``"arrays"``: ``[name, dtype, shape]`` of each array, in order; the
arrays follow as raw little-endian bytes; the CRC-32 covers everything before it. A writer streams the arrays
from their own buffers (no copy of the whole), the CRC computed on a thread beside the writes for large ones;
a reader fills new arrays a piece at a time and checks the CRC (and, when given, the one a store kept) before
anything is returned.

>>> blob = to_bytes(b"EXAMPLE1", {"note": "hi"}, [("x", np.arange(3, dtype=np.int32))])
>>> fields, arrays = from_bytes(blob, b"EXAMPLE1", "example")
>>> fields["note"], arrays["x"].tolist()
('hi', [0, 1, 2])
>>> from_bytes(blob[:-1], b"EXAMPLE1", "example")
Traceback (most recent call last):
...
clipd.engine._container.CorruptStateError: example: checksum mismatch (truncated or corrupted)
"""

from __future__ import annotations

import concurrent.futures
import functools
import io
import json
import struct
import sys
import zlib
from collections.abc import Iterator, Sequence
from typing import BinaryIO, Protocol

import numpy as np

_HEAD = struct.Struct("<8sQ")  # magic, header length
_CRC = struct.Struct("<I")
_IO_PIECE = 16 << 20  # bytes an array is written or read in at a time (the CRC runs over each piece)


class BinaryReader(Protocol):
    """A binary file :func:`read` reads from (an ``open(..., "rb")`` file, an ``io.BytesIO``)."""

    def read(self, size: int = -1, /) -> bytes: ...

    def readinto(self, buffer: memoryview, /) -> int | None: ...


class CorruptStateError(ValueError):
    """A blob (a checkpoint, a release) is truncated, corrupted or of another format.

    >>> read(io.BytesIO(b"NOTCLIPD" + bytes(12)), 20, b"CLIPDPS1", "partial state")
    Traceback (most recent call last):
    ...
    clipd.engine._container.CorruptStateError: partial state: unknown format b'NOTCLIPD'
    """


def write(file: BinaryIO, magic: bytes, fields: dict, arrays: Sequence[tuple[str, np.ndarray]]) -> tuple[int, int]:
    """Writes one container to ``file``; returns ``(bytes written, CRC-32 of all of it)``, what a store keeps.

    The arrays are written from their own buffers, a piece at a time (on a big-endian host, one piece at a
    time is swapped). For large ones the CRC runs over the same pieces on a thread of its own (both release
    the GIL): writing takes as long as the slower of the two, not their sum.
    """
    header = json.dumps({**fields, "arrays": [[name, a.dtype.newbyteorder("<").str, list(a.shape)]
                                              for name, a in arrays]}, separators=(",", ":")).encode()
    head = _HEAD.pack(magic, len(header))
    crc = zlib.crc32(header, zlib.crc32(head))
    file.write(head)
    file.write(header)
    array_bytes = sum(a.nbytes for _, a in arrays)
    if array_bytes >= _IO_PIECE and sys.byteorder == "little":  # views of the arrays: no copies
        pieces = list(_pieces(arrays))
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="clipd-crc") as pool:
            running = pool.submit(functools.reduce, lambda crc, piece: zlib.crc32(piece, crc), pieces, crc)
            for piece in pieces:
                file.write(piece)
            crc = running.result()
    else:
        for piece in _pieces(arrays):
            crc = zlib.crc32(piece, crc)
            file.write(piece)
    trailer = _CRC.pack(crc)
    file.write(trailer)
    return len(head) + len(header) + array_bytes + _CRC.size, zlib.crc32(trailer, crc)


def read(file: BinaryReader, nbytes: int, magic: bytes, what: str,
         crc32: int | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """Reads a container of ``nbytes`` bytes: its fields (the header less ``"arrays"``) and its arrays by name.

    ``CorruptStateError`` (its message starting with ``what``) if it is truncated, altered or not ``magic``'s:
    its own CRC-32 is checked, and ``crc32`` (what :func:`write` returned) when given.
    """
    if nbytes < _HEAD.size + _CRC.size:
        raise CorruptStateError(f"{what}: {nbytes} bytes is too short")
    head = _read_exactly(file, _HEAD.size, what)
    found, header_len = _HEAD.unpack(head)
    if found != magic:
        raise CorruptStateError(f"{what}: unknown format {bytes(found)!r}")
    if header_len > nbytes - _HEAD.size - _CRC.size:
        raise CorruptStateError(f"{what}: checksum mismatch (truncated or corrupted)")
    raw_header = _read_exactly(file, header_len, what)
    crc = zlib.crc32(raw_header, zlib.crc32(head))
    try:
        fields = json.loads(raw_header)
        left = nbytes - _HEAD.size - header_len - _CRC.size
        arrays = {}
        for name, dtype, shape in fields.pop("arrays"):
            dtype = np.dtype(dtype)
            size = int(np.prod(shape, dtype=np.int64))
            if size * dtype.itemsize > left:
                raise CorruptStateError(f"{what}: checksum mismatch (truncated or corrupted)")
            array = np.empty(size, dtype)
            crc = _read_into(file, array.data.cast("B"), crc, what)
            left -= size * dtype.itemsize
            arrays[name] = array.astype(dtype.newbyteorder("="), copy=False).reshape(shape)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CorruptStateError):
            raise
        raise CorruptStateError(f"{what}: malformed header ({e})") from None
    if left != 0:
        raise CorruptStateError(f"{what}: the arrays do not fill the blob")
    trailer = _read_exactly(file, _CRC.size, what)
    if _CRC.unpack(trailer)[0] != crc:
        raise CorruptStateError(f"{what}: checksum mismatch (truncated or corrupted)")
    if crc32 is not None and zlib.crc32(trailer, crc) != crc32:
        raise CorruptStateError(f"{what}: CRC-32 differs from the store's")
    return fields, arrays


def to_bytes(magic: bytes, fields: dict, arrays: Sequence[tuple[str, np.ndarray]]) -> bytes:
    """:func:`write`'s container in one ``bytes`` (a store that keeps blobs in a database row)."""
    out = io.BytesIO()
    write(out, magic, fields, arrays)
    return out.getvalue()


def from_bytes(data: bytes | memoryview, magic: bytes, what: str) -> tuple[dict, dict[str, np.ndarray]]:
    """:func:`read` from one ``bytes``."""
    data = memoryview(data).cast("B")
    return read(io.BytesIO(data), len(data), magic, what)


def _pieces(arrays: Sequence[tuple[str, np.ndarray]]) -> Iterator[memoryview]:
    """The arrays' bytes, little-endian, in pieces of at most ``_IO_PIECE`` (views of the arrays themselves on a
    little-endian host)."""
    for _, array in arrays:
        flat = np.ascontiguousarray(array).reshape(-1)
        step = max(1, _IO_PIECE // max(1, flat.itemsize))
        for start in range(0, flat.size, step):
            piece = flat[start : start + step]
            if sys.byteorder != "little" and piece.dtype.byteorder != "|":
                piece = piece.astype(piece.dtype.newbyteorder("<"))
            yield piece.data.cast("B")


def _read_exactly(file: BinaryReader, n: int, what: str) -> bytes:
    data = file.read(n)
    if len(data) != n:
        raise CorruptStateError(f"{what}: checksum mismatch (truncated or corrupted)")
    return data


def _read_into(file: BinaryReader, view: memoryview, crc: int, what: str) -> int:
    """Fills ``view`` from ``file`` a piece at a time; returns the CRC-32 continued over what was read."""
    for start in range(0, len(view), _IO_PIECE):
        piece = view[start : start + _IO_PIECE]
        got = file.readinto(piece)
        if got != len(piece):
            raise CorruptStateError(f"{what}: checksum mismatch (truncated or corrupted)")
        crc = zlib.crc32(piece, crc)
    return crc
