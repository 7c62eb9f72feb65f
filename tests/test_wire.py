"""The wire protocol of clipd.wire: the hand-written Submit codec (the client's encoder, the server's
parser) against the protobuf library, and its tables against the .proto and the engine."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from clipd import wire
from clipd.engine import BoundKind, NonFinite
from clipd.engine import _privacy as dp
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
        chunks=[pb.TensorChunk(layer=k, dtype=d, shape=s, offset=o, data=b) for k, d, s, o, b in cs],
    )


def _as_tuple(m):
    return (m.aggregation_id, m.client_id, m.sequence, m.writer_id,
            [(c.layer, c.dtype, tuple(c.shape), c.offset, bytes(c.data)) for c in m.chunks])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(requests)
def test_client_encoding_parses_with_protobuf(request):
    agg, client, seq, cs, writer = request
    encoded = wire.submit_request(
        agg, client, seq, [wire.tensor_chunk(k, d, s, o, np.frombuffer(b, np.uint8)) for k, d, s, o, b in cs],
        writer,
    )
    assert _as_tuple(pb.SubmitRequest.FromString(encoded)) == _as_tuple(_protobuf(*request))
    assert encoded == _protobuf(*request).SerializeToString()  # byte-identical to protobuf's own output


@settings(max_examples=200, deadline=None, derandomize=True)
@given(requests)
def test_server_parses_what_protobuf_writes(request):
    data = _protobuf(*request).SerializeToString()
    parsed = wire.parse_submit_request(data)
    assert _as_tuple(parsed) == _as_tuple(_protobuf(*request))
    for chunk in parsed.chunks:
        assert isinstance(chunk.data, memoryview)  # no copy of the payload


def test_unpacked_shape_and_unknown_fields_are_understood():
    chunk = bytes([0x08, 3, 0x18, 5, 0x18, 7, 0x2A, 2, 1, 2, 0xF8, 0x06, 1])  # unpacked shape, field 111
    message = bytes([0x22, len(chunk)]) + chunk + bytes([0x18, 9, 0x9D, 0x06, 0, 0, 0, 0])  # + fixed32 field 99
    parsed = wire.parse_submit_request(message)
    reference = pb.SubmitRequest.FromString(message)
    assert _as_tuple(parsed) == _as_tuple(reference)


def test_tags_beyond_32_bits_are_refused_as_protobuf_refuses_them():
    for tag in (bytes([0x80, 0x80, 0x80, 0x80, 0x10]), bytes([0x98, 0x80, 0x80, 0x80, 0x80, 0x00])):  # field 2^29; 6 bytes
        with pytest.raises(DecodeError):
            pb.SubmitRequest.FromString(tag + b"\x01")
        with pytest.raises(ValueError, match="field number|overlong"):
            wire.parse_submit_request(tag + b"\x01")
    assert wire.parse_submit_request(bytes([0x98, 0x80, 0x80, 0x80, 0x00, 0x01])).sequence == 1  # 5 bytes: a tag still


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
        parsed = wire.parse_submit_request(corrupted)
    except ValueError:
        parsed = None
    if reference is not None and parsed is not None:
        assert _as_tuple(parsed) == _as_tuple(reference)
    # Where protobuf accepts a message that we refuse (or the reverse), only malformed UTF-8 or
    # wire-type mismatches may explain it; neither ever yields wrong data.


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(1, 5), st.lists(st.integers(1, 6), max_size=3),
                          st.sampled_from(["float32", "float16", "float64"])), min_size=1, max_size=4),
       st.integers(1, 200))
def test_a_batch_split_into_messages_is_read_back_whole(layers, max_bytes):
    rows = layers[0][0]
    rng = np.random.default_rng(len(layers) + max_bytes)
    batch = [rng.standard_normal((rows, *shape)).astype(dtype) for _, shape, dtype in layers]
    messages = wire.submit_batch("agg", "c", 7, batch, max_bytes, "w")
    received = [bytearray() for _ in batch]
    for message in messages:
        parsed = wire.parse_submit_request(message)
        assert (parsed.aggregation_id, parsed.client_id, parsed.sequence, parsed.writer_id) == ("agg", "c", 7, "w")
        assert sum(len(c.data) for c in parsed.chunks) <= max_bytes
        for chunk in parsed.chunks:
            assert chunk.offset == len(received[chunk.layer])  # in order
            assert wire.DTYPE_NAMES[chunk.dtype] == batch[chunk.layer].dtype.name
            assert chunk.shape == batch[chunk.layer].shape
            received[chunk.layer] += chunk.data
    for array, data in zip(batch, received):
        np.testing.assert_array_equal(wire.as_array(data, array.dtype.name, array.shape), array)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(1, 5), st.lists(st.integers(1, 6), max_size=3),
                          st.sampled_from(["float32", "float16", "float64"])), min_size=1, max_size=4),
       st.integers(1, 200), st.sampled_from(["bfloat16", "float16"]))
def test_a_narrow_batch_is_read_back_as_the_16_bit_values_of_its_float32_layers(layers, max_bytes, wire_dtype):
    """With a 16-bit wire dtype the float32 layers' chunks say BFLOAT16 (FLOAT16) and carry the whole
    2-byte tensor, in order, in whole elements; the other layers go as they are. The generator and the
    list agree."""
    rows = layers[0][0]
    rng = np.random.default_rng(len(layers) + max_bytes)
    batch = [rng.standard_normal((rows, *shape)).astype(dtype) for _, shape, dtype in layers]
    messages = wire.submit_batch("agg", "c", 7, batch, max_bytes, "w", wire_dtype)
    assert messages == list(wire.iter_submit_batch("agg", "c", 7, batch, max_bytes, "w", wire_dtype))
    received = [bytearray() for _ in batch]
    for message in messages:
        for chunk in wire.parse_submit_request(message).chunks:
            array = batch[chunk.layer]
            assert chunk.offset == len(received[chunk.layer]) and chunk.shape == array.shape
            narrow = array.dtype == np.float32
            assert wire.DTYPE_NAMES[chunk.dtype] == (wire_dtype if narrow else array.dtype.name)
            assert not narrow or (chunk.offset % 2 == 0 and len(chunk.data) % 2 == 0 and chunk.data)
            received[chunk.layer] += chunk.data
    for array, data in zip(batch, received):
        if array.dtype == np.float32:
            assert bytes(data) == wire.to_wire_dtype(array.reshape(-1), wire_dtype).tobytes()
            widened = wire.widen_into(data, wire_dtype, np.empty(array.size, np.float32))
            np.testing.assert_array_equal(widened, wire.as_array(data, wire_dtype, (array.size,)).astype(np.float32))
        else:
            np.testing.assert_array_equal(wire.as_array(data, array.dtype.name, array.shape), array)


def test_the_tables_cover_the_proto_enums_and_name_the_engine_enums():
    assert set(wire.DTYPES.values()) == set(pb.DType.values()) - {pb.DTYPE_UNSPECIFIED}
    assert set(wire.CLIP_KINDS.values()) == set(pb.ClipPolicy.Kind.values()) - {pb.ClipPolicy.KIND_UNSPECIFIED}
    assert set(wire.NON_FINITE.values()) == set(pb.ClipPolicy.NonFinite.values()) - {pb.ClipPolicy.NON_FINITE_UNSPECIFIED}
    assert set(wire.SAMPLING.values()) == set(pb.Sampling.Kind.values())
    assert set(wire.NEIGHBOURING.values()) == set(pb.PrivacyPolicy.Neighbouring.values())
    assert set(wire.ACCOUNTANTS.values()) == set(pb.PrivacyPolicy.Accountant.values())
    # The server turns the wire's names into the engine's enums by value.
    assert set(wire.CLIP_KINDS) == {k.value for k in BoundKind}
    assert set(wire.NON_FINITE) == {k.value for k in NonFinite} | {"reject"}
    assert set(wire.SAMPLING) == {k.value for k in dp.SamplingKind}
    assert set(wire.NEIGHBOURING) == {k.value for k in dp.Neighbouring}
    assert set(wire.ACCOUNTANTS) == {k.value for k in dp.Accountant}
    assert wire.SUBMIT_METHOD == "/clipd.v1.Clipd/Submit"


def test_the_retry_hint_and_the_examples_of_the_module():
    assert wire.retry_after([("retry-after-ms", "250")]) == 0.25
    assert wire.retry_after([("retry-after-ms", "soon")]) is None and wire.retry_after(None) is None
    assert wire.retry_after(wire.retry_after_metadata(-1)) == 0.0
    assert doctest.testmod(wire).failed == 0


def test_a_big_endian_array_goes_on_the_wire_little_endian():
    """The dtype codes mean little-endian: a ``>f4`` batch (and a ``>f8`` sum) is sent as the same values in
    little-endian bytes, which protobuf's parser and numpy read back equal."""
    from clipd.server.rpc import codec

    values = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    (message,) = wire.submit_batch("agg", "alice", 1, [values.astype(">f4")], 1 << 20)
    (chunk,) = pb.SubmitRequest.FromString(message).chunks
    assert chunk.data == values.astype("<f4").tobytes()
    sums = values.astype(">f8")
    (sent,) = codec.tensor_chunks(0, sums, 1 << 20)
    assert sent.data == values.astype("<f8").tobytes()
