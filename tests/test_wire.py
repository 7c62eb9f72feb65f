"""The hand-written Submit wire codec (client encoder, server parser) against the protobuf library."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from clipd.client import wire as client_wire
from clipd.server.rpc import wire as server_wire
from clipd.v1 import clipd_pb2 as pb

chunks = st.lists(
    st.tuples(
        st.integers(0, 2**32 - 1),  # layer
        st.sampled_from([0, 1, 2, 3, 4]),  # dtype
        st.lists(st.integers(0, 2**40), max_size=4),  # shape
        st.integers(0, 2**63),  # offset
        st.binary(max_size=300),  # data
    ),
    max_size=4,
)
requests = st.tuples(st.text(max_size=20), st.text(max_size=20), st.integers(0, 2**64 - 1), chunks, st.text(max_size=20))


def _protobuf(agg, client, seq, cs, writer) -> pb.SubmitRequest:
    return pb.SubmitRequest(
        aggregation_id=agg, client_id=client, sequence=seq, writer_id=writer,
        chunks=[pb.TensorChunk(layer=l, dtype=d, shape=s, offset=o, data=b) for l, d, s, o, b in cs],
    )


def _as_tuple(m):
    return (m.aggregation_id, m.client_id, m.sequence, m.writer_id,
            [(c.layer, c.dtype, tuple(c.shape), c.offset, bytes(c.data)) for c in m.chunks])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(requests)
def test_client_encoding_parses_with_protobuf(request):
    agg, client, seq, cs, writer = request
    encoded = client_wire.submit_request(
        agg, client, seq, [client_wire.tensor_chunk(l, d, s, o, np.frombuffer(b, np.uint8)) for l, d, s, o, b in cs],
        writer,
    )
    assert _as_tuple(pb.SubmitRequest.FromString(encoded)) == _as_tuple(_protobuf(*request))
    assert encoded == _protobuf(*request).SerializeToString()  # byte-identical to protobuf's own output


@settings(max_examples=200, deadline=None, derandomize=True)
@given(requests)
def test_server_parses_what_protobuf_writes(request):
    data = _protobuf(*request).SerializeToString()
    parsed = server_wire.parse_submit_request(data)
    assert _as_tuple(parsed) == _as_tuple(_protobuf(*request))
    for chunk in parsed.chunks:
        assert isinstance(chunk.data, memoryview)  # no copy of the payload


def test_unpacked_shape_and_unknown_fields_are_understood():
    chunk = bytes([0x08, 3, 0x18, 5, 0x18, 7, 0x2A, 2, 1, 2, 0xF8, 0x06, 1])  # unpacked shape, field 111
    message = bytes([0x22, len(chunk)]) + chunk + bytes([0x18, 9, 0x9D, 0x06, 0, 0, 0, 0])  # + fixed32 field 99
    parsed = server_wire.parse_submit_request(message)
    reference = pb.SubmitRequest.FromString(message)
    assert _as_tuple(parsed) == _as_tuple(reference)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(requests, st.data())
def test_corrupted_messages_raise_value_error_or_parse_like_protobuf(request, data):
    message = bytearray(_protobuf(*request).SerializeToString())
    if not message:
        return
    cut = data.draw(st.integers(0, len(message) - 1))
    flip = data.draw(st.integers(0, 255))
    corrupted = bytes(message[:cut]) if data.draw(st.booleans()) else bytes(message[:cut] + bytes([flip]) + message[cut + 1:])
    try:
        reference = pb.SubmitRequest.FromString(corrupted)
    except Exception:
        reference = None
    try:
        parsed = server_wire.parse_submit_request(corrupted)
    except ValueError:
        parsed = None
    if reference is not None and parsed is not None:
        assert _as_tuple(parsed) == _as_tuple(reference)
    # Where protobuf accepts a message that we refuse (or the reverse), only malformed UTF-8 or
    # wire-type mismatches may explain it; neither ever yields wrong data.
