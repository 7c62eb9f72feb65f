"""Parsing SubmitRequest wire bytes without copying the tensor data.

protobuf's parser copies every ``bytes`` field into a new Python object; for
the payload of Submit (megabytes a message) that copy costs more than the rest
of the request path. This parser returns the same fields with ``data`` as a
``memoryview`` into the received message. Anything that is not a well-formed
SubmitRequest raises ``ValueError`` (the RPC then fails, as with a protobuf
parse error). Unknown fields are skipped, as protobuf does.
"""

from __future__ import annotations

from typing import NamedTuple

_MAX_VARINT_BYTES = 10


class Chunk(NamedTuple):
    layer: int
    dtype: int
    shape: tuple[int, ...]
    offset: int
    data: memoryview


class SubmitMessage(NamedTuple):
    aggregation_id: str
    client_id: str
    sequence: int
    chunks: list[Chunk]
    writer_id: str = ""


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(pos, min(end, pos + _MAX_VARINT_BYTES)):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, i + 1
        shift += 7
    raise ValueError("truncated or overlong varint")


def _fields(buf: memoryview, pos: int, end: int):
    """Yields ``(field, wire_type, value)``: an int (varint), a ``(start, stop)`` span, or None."""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise ValueError("field number 0")
        if wire_type == 0:
            value, pos = _varint(buf, pos, end)
        elif wire_type == 2:
            size, pos = _varint(buf, pos, end)
            if pos + size > end:
                raise ValueError("truncated length-delimited field")
            value, pos = (pos, pos + size), pos + size
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
            if pos > end:
                raise ValueError("truncated fixed-width field")
            value = None
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        yield field, wire_type, value


def _chunk(buf: memoryview, start: int, end: int) -> Chunk:
    layer = dtype = offset = 0
    shape: list[int] = []
    data = buf[start:start]
    for field, wire_type, value in _fields(buf, start, end):
        if field == 1 and wire_type == 0:
            layer = value & 0xFFFFFFFF
        elif field == 2 and wire_type == 0:
            dtype = value
        elif field == 3 and wire_type == 0:
            shape.append(value)
        elif field == 3 and wire_type == 2:  # packed
            pos, stop = value
            while pos < stop:
                dim, pos = _varint(buf, pos, stop)
                shape.append(dim)
        elif field == 4 and wire_type == 0:
            offset = value
        elif field == 5 and wire_type == 2:
            data = buf[value[0] : value[1]]
        elif field in (1, 2, 3, 4, 5):
            raise ValueError(f"TensorChunk field {field} has wire type {wire_type}")
    return Chunk(layer, dtype, tuple(d - (1 << 64) if d >= 1 << 63 else d for d in shape), offset, data)


def parse_submit_request(message: bytes) -> SubmitMessage:
    """The fields of a serialized SubmitRequest, tensor data as memoryviews of ``message``."""
    buf = memoryview(message)
    aggregation_id = client_id = writer_id = ""
    sequence = 0
    chunks = []
    for field, wire_type, value in _fields(buf, 0, len(buf)):
        if field in (1, 2, 5) and wire_type == 2:
            text = str(buf[value[0] : value[1]], "utf-8")
            if field == 1:
                aggregation_id = text
            elif field == 2:
                client_id = text
            else:
                writer_id = text
        elif field == 3 and wire_type == 0:
            sequence = value
        elif field == 4 and wire_type == 2:
            chunks.append(_chunk(buf, *value))
        elif field in (1, 2, 3, 4, 5):
            raise ValueError(f"SubmitRequest field {field} has wire type {wire_type}")
    return SubmitMessage(aggregation_id, client_id, sequence, chunks, writer_id)
