"""Encoding SubmitRequest messages straight to protobuf wire bytes.

A batch's tensor bytes are copied once, into the message, instead of three
times (``tobytes``, the protobuf field, serialization): the message is the
concatenation of a small header and the raw little-endian data. The layout is
plain proto3 (see ``proto/clipd/v1/clipd.proto``); tests check it against the
protobuf library both ways.
"""

from __future__ import annotations

from collections.abc import Sequence


def varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative integer.

    >>> varint(300).hex()
    'ac02'
    """
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _string(field: int, value: bytes) -> list[bytes]:
    return [varint(field << 3 | 2), varint(len(value)), value] if value else []


def _uint(field: int, value: int) -> bytes:
    return varint(field << 3) + varint(value) if value else b""


def tensor_chunk(layer: int, dtype: int, shape: Sequence[int], offset: int, data) -> list:
    """The parts of one TensorChunk message (``data``: any bytes-like object, not copied here)."""
    dims = b"".join(varint(d) for d in shape)
    head = (_uint(1, layer) + _uint(2, dtype) + (varint(3 << 3 | 2) + varint(len(dims)) + dims if dims else b"")
            + _uint(4, offset))
    size = data.nbytes if hasattr(data, "nbytes") else len(data)
    tail = [varint(5 << 3 | 2), varint(size), data] if size else []
    return [head, *tail]


def submit_request(aggregation_id: str, client_id: str, sequence: int, chunks: Sequence[list],
                   writer_id: str = "") -> bytes:
    """One serialized SubmitRequest; ``chunks`` are ``tensor_chunk`` results."""
    parts: list = [*_string(1, aggregation_id.encode()), *_string(2, client_id.encode()), _uint(3, sequence)]
    for chunk in chunks:
        size = sum(len(p) if isinstance(p, (bytes, bytearray)) else p.nbytes for p in chunk)
        parts += [varint(4 << 3 | 2), varint(size), *chunk]
    parts += _string(5, writer_id.encode())
    return b"".join(parts)
