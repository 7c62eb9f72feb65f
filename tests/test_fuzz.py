"""Fuzzing the Submit parser: against protobuf's own parser, and live beside an honest client."""

from __future__ import annotations

import threading

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clipd import wire
from clipd.v1 import clipd_pb2 as pb

LAYERS = {"w": (3, 4), "b": (5,)}


def _valid_messages(aggregation: str, client: str, rows: int = 2) -> list[bytes]:
    rng = np.random.default_rng(rows)
    chunks = [pb.TensorChunk(layer=k, dtype=pb.FLOAT32, shape=[rows, *shape], offset=0,
                             data=rng.standard_normal((rows, *shape)).astype(np.float32).tobytes())
              for k, shape in enumerate(LAYERS.values())]
    return [pb.SubmitRequest(aggregation_id=aggregation, client_id=client, writer_id="w").SerializeToString(),
            pb.SubmitRequest(aggregation_id=aggregation, client_id=client, sequence=1, chunks=chunks[:1],
                             writer_id="w").SerializeToString(),
            pb.SubmitRequest(aggregation_id=aggregation, client_id=client, sequence=1,
                             chunks=chunks[1:]).SerializeToString()]


@st.composite
def mutated(draw, messages: list[bytes]) -> bytes:
    """A valid message with bytes flipped, cut, or inserted; or plain random bytes."""
    if draw(st.booleans()) and draw(st.booleans()):
        return draw(st.binary(max_size=64))
    data = bytearray(draw(st.sampled_from(messages)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "cut", "insert"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


VALID = _valid_messages("fuzz", "c")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(VALID))
def test_the_zero_copy_parser_agrees_with_protobuf(data):
    """Whatever ours accepts, protobuf parses to the same fields; what protobuf refuses, ours refuses."""
    try:
        ours = wire.parse_submit_request(data)
    except ValueError:
        ours = None
    try:
        theirs = pb.SubmitRequest.FromString(data)
    except DecodeError:
        assert ours is None
        return
    if ours is None:
        return  # ours is stricter on wire types of known fields (protobuf keeps them as unknown fields)
    assert (ours.aggregation_id, ours.client_id, ours.sequence, ours.writer_id) == (
        theirs.aggregation_id, theirs.client_id, theirs.sequence, theirs.writer_id)
    assert len(ours.chunks) == len(theirs.chunks)
    for a, b in zip(ours.chunks, theirs.chunks):
        assert (a.layer, a.dtype, list(a.shape), a.offset, bytes(a.data)) == (
            b.layer, b.dtype, list(b.shape), b.offset, b.data)


def test_a_fuzzed_submit_stream_never_disturbs_an_honest_client(server, client):
    honest = client.create_aggregation(LAYERS, l2_norm_clip=float("inf"))
    target = client.create_aggregation(LAYERS)
    rng = np.random.default_rng(7)
    updates = {name: rng.standard_normal((300, *shape)).astype(np.float32) for name, shape in LAYERS.items()}
    done = threading.Event()
    outcome = {}

    def submit_honestly():
        try:
            for k in range(30):  # 30 submissions of 10 examples, interleaved with the fuzzing
                client.submit(honest, {n: u[10 * k: 10 * (k + 1)] for n, u in updates.items()}, client_id="h")
        except Exception as e:  # reported below
            outcome["error"] = e
        done.set()

    thread = threading.Thread(target=submit_honestly)
    thread.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    submit = channel.stream_stream(wire.SUBMIT_METHOD, request_serializer=None, response_deserializer=None)
    messages = _valid_messages(target, "fuzzer")
    seen = {}
    allowed = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
               grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])
    @given(st.lists(mutated(messages), min_size=1, max_size=4))
    def fuzz(stream):
        try:
            list(submit(iter(stream), timeout=20))
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
            assert code in allowed, (code, e.details(), stream)
        seen[code] = seen.get(code, 0) + 1

    fuzz()
    thread.join(timeout=120)
    assert done.is_set() and "error" not in outcome, outcome
    result = client.finalize(honest)
    assert result.examples == 300
    for name, u in updates.items():
        np.testing.assert_allclose(result.sums[name], u.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)
    assert seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 50  # the fuzzer did reach the parser
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    assert server.servicer.budget.used == 0
    channel.close()
