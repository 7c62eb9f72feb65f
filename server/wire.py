"""Parsing SubmitRequest wire bytes without copying the tensor data.

protobuf's parser copies every ``bytes`` field into a new Python object; for
the payload of Submit (megabytes a message) that copy costs more than the rest
of the request path. This parser returns the same fields with ``data`` as a
``memoryview`` into the received message. Anything that is not a well-formed
SubmitRequest raises ``ValueError`` (the RPC then fails, as with a protobuf
parse error). Unknown fields are skipped, as protobuf does.

Between an ingest process and the server process (``clipd serve --processes N``,
see :mod:`clipd.server.ingest`), a chunk carries its data in shared memory: a
field that no public message has, ``TensorChunk`` field 15, names the region
(``SharedRef``: segment, offset, length, and the region's random tag). Only
the parser of the internal socket resolves it (``regions``); the public one
skips it as any unknown field, and the ingest process re-encodes every message
it forwards (a client's own field 15 is dropped), so a client can't name a
region; a stale reference is refused by its tag.
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


SHARED_REF_FIELD = 15  # TensorChunk field of the internal link: the data is in shared memory


def _shared_ref(buf: memoryview, start: int, end: int) -> tuple[str, int, int, int]:
    segment, offset, length, tag = "", 0, 0, 0
    for field, wire_type, value in _fields(buf, start, end):
        if field == 1 and wire_type == 2:
            segment = str(buf[value[0] : value[1]], "ascii")
        elif field == 2 and wire_type == 0:
            offset = value
        elif field == 3 and wire_type == 0:
            length = value
        elif field == 4 and wire_type == 0:
            tag = value
    return segment, offset, length, tag


def _chunk(buf: memoryview, start: int, end: int, regions=None) -> Chunk:
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
        elif field == SHARED_REF_FIELD and wire_type == 2 and regions is not None:
            data = regions.view(*_shared_ref(buf, *value))
        elif field in (1, 2, 3, 4, 5):
            raise ValueError(f"TensorChunk field {field} has wire type {wire_type}")
    return Chunk(layer, dtype, tuple(d - (1 << 64) if d >= 1 << 63 else d for d in shape), offset, data)


def parse_submit_request(message: bytes, regions=None) -> SubmitMessage:
    """The fields of a serialized SubmitRequest, tensor data as memoryviews of ``message``.

    ``regions`` (the internal link only): resolves shared-memory chunk data,
    ``regions.view(segment, offset, length) -> memoryview``.
    """
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
            chunks.append(_chunk(buf, *value, regions))
        elif field in (1, 2, 3, 4, 5):
            raise ValueError(f"SubmitRequest field {field} has wire type {wire_type}")
    return SubmitMessage(aggregation_id, client_id, sequence, chunks, writer_id)


# Encoding (the ingest process forwards a message with its data moved to shared memory) ------
def _put_varint(out: bytearray, value: int) -> None:
    value &= 0xFFFFFFFFFFFFFFFF
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _put_bytes(out: bytearray, field: int, data: bytes) -> None:
    _put_varint(out, field << 3 | 2)
    _put_varint(out, len(data))
    out += data


def _put_int(out: bytearray, field: int, value: int) -> None:
    _put_varint(out, field << 3)
    _put_varint(out, value)


def encode_shared(message: SubmitMessage, refs: list[tuple[str, int, int, int]]) -> bytes:
    """A SubmitRequest equal to ``message`` but for each chunk's data, which is the shared region ``refs[i]``.

    >>> chunk = Chunk(1, 2, (3, 4), 0, memoryview(b"x" * 48))
    >>> forwarded = encode_shared(SubmitMessage("agg", "c", 7, [chunk], "w"), [("seg", 64, 48, 99)])
    >>> class Regions:
    ...     def view(self, segment, offset, length, tag): return (segment, offset, length, tag)
    >>> parse_submit_request(forwarded, Regions())
    SubmitMessage(aggregation_id='agg', client_id='c', sequence=7, chunks=[Chunk(layer=1, dtype=2, shape=(3, 4), offset=0, data=('seg', 64, 48, 99))], writer_id='w')
    >>> parse_submit_request(forwarded).chunks[0].data.nbytes  # the public parser skips the reference
    0
    """
    out = bytearray()
    _put_bytes(out, 1, message.aggregation_id.encode())
    _put_bytes(out, 2, message.client_id.encode())
    _put_int(out, 3, message.sequence)
    for chunk, (segment, offset, length, tag) in zip(message.chunks, refs, strict=True):
        body = bytearray()
        _put_int(body, 1, chunk.layer)
        _put_int(body, 2, chunk.dtype)
        shape = bytearray()
        for dim in chunk.shape:
            _put_varint(shape, dim)
        _put_bytes(body, 3, bytes(shape))
        _put_int(body, 4, chunk.offset)
        ref = bytearray()
        _put_bytes(ref, 1, segment.encode())
        _put_int(ref, 2, offset)
        _put_int(ref, 3, length)
        _put_int(ref, 4, tag)
        _put_bytes(body, SHARED_REF_FIELD, bytes(ref))
        _put_bytes(out, 4, bytes(body))
    _put_bytes(out, 5, message.writer_id.encode())
    return bytes(out)
