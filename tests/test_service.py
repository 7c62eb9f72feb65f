"""The real gRPC server on loopback, driven by the real client (and a raw stub for bad input)."""

from __future__ import annotations

import re
import threading

import grpc
import numpy as np
import pytest
from conftest import TEST_SETTINGS
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import wait_until
from service_helpers import LAYERS, FaultyProxy, assert_result_matches, make_updates, reference

from clipd.client import (
    AlreadyExistsError,
    Client,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from clipd.server.app import create_server
from clipd.server.settings import Settings
from clipd.v1 import clipd_pb2 as pb
from clipd.v1 import clipd_pb2_grpc as pb_grpc


@pytest.fixture(params=["one message", "stream"])
def client(server, request):
    """The conftest's client, twice: a submission that fits one message goes as one SubmitOne call, or always on a
    Submit stream (``one_message=False``): every contract below holds on both paths."""
    with Client(f"127.0.0.1:{server.port}", message_bytes=64 << 10, max_message_bytes=4 << 20,
                one_message=request.param == "one message") as client:
        yield client


@pytest.mark.parametrize(
    "policy,clip,layer_clips",
    [
        ("global", 1.0, None),
        ("global", 0.0, None),
        ("global", float("inf"), None),
        ("per_layer_uniform", 0.7, None),
        ("per_layer_proportional", 2.0, None),
        ("per_layer_explicit", None, (0.5, 1.0, float("inf"))),
    ],
)
def test_every_policy_matches_the_engine(client, policy, clip, layer_clips):
    updates = make_updates(45, seed=1)
    kwargs = dict(layer_clips=layer_clips) if layer_clips else dict(l2_norm_clip=clip)
    agg = client.create_aggregation(LAYERS, policy=policy, **kwargs)
    # A mix of shapes of input: one batch, single examples, and an iterator of batches.
    client.submit(agg, {k: v[:20] for k, v in updates.items()})
    client.submit(agg, ({k: v[i] for k, v in updates.items()} for i in range(20, 25)))
    client.submit(agg, iter([[updates[k][25:45] for k in LAYERS]]))
    assert_result_matches(client.finalize(agg), updates, policy, clip, layer_clips)


def test_rescale_and_non_finite_policies(client):
    updates = make_updates(12, seed=2)
    updates["w"][3, 0, 0] = np.nan
    updates["b"][7, 1] = np.inf
    good = {k: np.delete(v, [3, 7], axis=0) for k, v in updates.items()}
    # Default: a non-finite example is zeroed and counted, never poisons the sum.
    agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0)
    client.submit(agg, updates)
    result = client.finalize(agg)
    assert result.non_finite == 2 and result.examples == 12
    sums, counts = reference(good, "global", 1.0)
    assert result.clip_counts == counts
    for k in LAYERS:
        np.testing.assert_allclose(result.sums[k], sums[k], rtol=1e-5, atol=1e-6)
    # Rescaled to unit norm: every example contributes a vector of norm <= 1.
    agg = client.create_aggregation(LAYERS, l2_norm_clip=0.25, rescale_to_unit_norm=True)
    client.submit(agg, good)
    sums_unit = client.finalize(agg).sums
    clipped_sums, _ = reference(good, "global", 0.25)
    for k in LAYERS:
        np.testing.assert_allclose(sums_unit[k], clipped_sums[k] / 0.25, rtol=1e-5, atol=1e-6)


def test_reject_policy_refuses_the_whole_batch_and_keeps_the_rest(client):
    updates = make_updates(10, seed=3)
    agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0, non_finite="reject")
    client.submit(agg, {k: v[:5] for k, v in updates.items()})
    bad = {k: v[5:].copy() for k, v in updates.items()}
    bad["v"][2, 1, 0, 0] = np.nan
    with pytest.raises(InvalidArgumentError, match="layer 'v': example 2 holds NaN"):
        client.submit(agg, bad)
    assert client.stats(agg).examples == 5
    assert_result_matches(client.finalize(agg), {k: v[:5] for k, v in updates.items()})


def test_eight_concurrent_clients_into_one_aggregation(client, server):
    updates = make_updates(8 * 30, seed=4)
    agg = client.create_aggregation(LAYERS, policy="per_layer_uniform", l2_norm_clip=1.5)
    errors = []

    def send(i):
        try:
            with Client(f"127.0.0.1:{server.port}", message_bytes=4096) as own:
                own.submit(agg, {k: v[i * 30 : (i + 1) * 30] for k, v in updates.items()})
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert_result_matches(client.finalize(agg), updates, "per_layer_uniform", 1.5)


def test_update_larger_than_a_message_is_chunked():
    settings = Settings(**{**TEST_SETTINGS, "max_message_bytes": 256 << 10})
    server, port = create_server(settings)
    try:
        layers = {"big": (400, 500), "small": (3,)}  # 800 KB an example: 3x the message limit
        updates = make_updates(3, seed=5, layers=layers)
        with Client(f"127.0.0.1:{port}", message_bytes=100 << 10, max_message_bytes=256 << 10) as c:
            agg = c.create_aggregation(layers, l2_norm_clip=10.0)
            report = c.submit(agg, updates)
            assert report.batches == 3
            result = c.finalize(agg)  # the result comes back in chunks too
        assert_result_matches(result, updates, "global", 10.0)
    finally:
        server.stop(grace=1.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_dropped_connections_resume_exactly_once(server, seed):
    updates = make_updates(3000, seed=6 + seed)  # 480 KB
    proxy = FaultyProxy(server.port, faults=4, min_bytes=2_000, max_bytes=100_000, seed=seed)
    try:
        with Client(f"127.0.0.1:{proxy.port}", message_bytes=2048, retry_delay=0.01) as c:
            agg = c.create_aggregation(LAYERS, l2_norm_clip=1.0)
            report = c.submit(agg, updates)
            result = c.finalize(agg)
        assert proxy.cuts == 4 and report.reconnects >= 1
        assert_result_matches(result, updates)
    finally:
        proxy.close()


def test_resending_acknowledged_batches_counts_them_once(client, server):
    updates = make_updates(6, seed=7)
    agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0)
    stub = pb_grpc.ClipdStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    batches = [pb.SubmitRequest(aggregation_id=agg, client_id="trainer-1", sequence=i + 1,
                                chunks=_good_chunks(updates, slice(2 * i, 2 * i + 2))) for i in range(3)]
    assert _submit_raw(stub, batches)[-1].acknowledged_sequence == 3
    again = _submit_raw(stub, batches[1:])  # sequences 2 and 3 again (a client that missed the ack)
    assert again[-1].acknowledged_sequence == 3
    assert client.stats(agg).examples == 6
    assert_result_matches(client.finalize(agg), updates)


def test_a_hello_says_where_the_client_stands(client, server):
    updates = make_updates(4, seed=7)
    agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0)
    stub = pb_grpc.ClipdStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    hello = pb.SubmitRequest(aggregation_id=agg, client_id="t", sequence=0, writer_id="w1")
    assert _submit_raw(stub, [hello])[0].accepted_sequence == 0
    batch = pb.SubmitRequest(aggregation_id=agg, client_id="t", sequence=1, chunks=_good_chunks(updates))
    _submit_raw(stub, [hello, batch])
    answer = _submit_raw(stub, [pb.SubmitRequest(aggregation_id=agg, client_id="t", sequence=0, writer_id="w2")])[0]
    assert (answer.acknowledged_sequence, answer.accepted_sequence, answer.writer_id) == (1, 1, "w1")


# Malformed input, sent with a raw stub: each gets its status and changes nothing.
def _chunk(layer, array, dtype=pb.FLOAT32, shape=None, offset=0, data=None):
    return pb.TensorChunk(layer=layer, dtype=dtype, shape=shape or array.shape, offset=offset,
                          data=array.tobytes() if data is None else data)


def _good_chunks(updates, rows=slice(0, 2)):
    return [_chunk(k, np.ascontiguousarray(updates[name][rows])) for k, name in enumerate(LAYERS)]


def _submit_raw(stub, messages):
    return list(stub.Submit(iter(messages), timeout=30))


def _malformed_cases(updates):
    w, b, v = (np.ascontiguousarray(updates[n][:2]) for n in LAYERS)
    msg = lambda chunks, seq=2, **kw: pb.SubmitRequest(aggregation_id=kw.get("agg", "AGG"), client_id="c1",  # noqa: E731
                                                        sequence=seq, chunks=chunks)
    return {
        "unknown aggregation": ([msg([_chunk(0, w)], agg="nope")], grpc.StatusCode.NOT_FOUND, "no aggregation"),
        "missing layer": ([msg([_chunk(0, w), _chunk(1, b)])], grpc.StatusCode.INVALID_ARGUMENT, "ended inside batch 2"),
        "layer index": ([msg([_chunk(7, w)])], grpc.StatusCode.INVALID_ARGUMENT, "layer index 7"),
        "wrong shape": ([msg([_chunk(0, w.reshape(2, 4, 6))])], grpc.StatusCode.INVALID_ARGUMENT,
                        "layer 'w': shape \\[2, 4, 6\\], expected \\[batch, 6, 4\\]"),
        # (float16 and bfloat16 are taken for a float32 layer: half the bytes on the wire)
        "wrong dtype": ([msg([_chunk(0, w.astype(np.float64), dtype=pb.FLOAT64)])], grpc.StatusCode.INVALID_ARGUMENT,
                        "dtype float64, expected float32"),
        "unknown dtype": ([msg([_chunk(0, w, dtype=0)])], grpc.StatusCode.INVALID_ARGUMENT, "unsupported dtype"),
        "byte length": ([msg([_chunk(0, w, data=w.tobytes() + b"1234")])], grpc.StatusCode.INVALID_ARGUMENT,
                        "196 bytes, expected 192"),
        "batch sizes differ": ([msg([_chunk(0, w), _chunk(1, b[:1])])], grpc.StatusCode.INVALID_ARGUMENT,
                               "batch size 1, other layers have 2"),
        "chunk order": ([msg([_chunk(0, w[:1], shape=w.shape, offset=96)])], grpc.StatusCode.INVALID_ARGUMENT,
                        "chunk at byte 96, expected 0"),
        "sequence gap": ([msg([_chunk(0, w), _chunk(1, b), _chunk(2, v)], seq=5)], grpc.StatusCode.FAILED_PRECONDITION,
                         "batch 5 after 1"),
        "sequence zero": ([msg([_chunk(0, w)], seq=0)], grpc.StatusCode.INVALID_ARGUMENT, "sequence must be >= 1"),
        "two clients": ([msg([_chunk(0, w)]),
                         pb.SubmitRequest(aggregation_id="AGG", client_id="c2", sequence=3)],
                        grpc.StatusCode.INVALID_ARGUMENT, "one aggregation and one client_id"),
    }


@pytest.mark.parametrize("case", list(_malformed_cases(make_updates(2))))
def test_malformed_batches_are_rejected_and_change_nothing(client, server, case):
    updates = make_updates(4, seed=8)
    agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0)
    stub = pb_grpc.ClipdStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    first = pb.SubmitRequest(aggregation_id=agg, client_id="c1", sequence=1, chunks=_good_chunks(updates))
    assert _submit_raw(stub, [first])[-1].acknowledged_sequence == 1
    messages, code, pattern = _malformed_cases(updates)[case]
    for m in messages:
        if m.aggregation_id == "AGG":
            m.aggregation_id = agg
    with pytest.raises(grpc.RpcError) as info:
        _submit_raw(stub, messages)
    assert info.value.code() == code
    assert re.search(pattern, info.value.details()), info.value.details()
    assert client.stats(agg).examples == 2
    assert_result_matches(client.finalize(agg), {k: v[:2] for k, v in updates.items()})


def test_oversized_message_and_batch_are_resource_exhausted():
    server, port = create_server(Settings(**{**TEST_SETTINGS, "max_message_bytes": 64 << 10,
                                             "max_batch_bytes": 100 << 10}))
    try:
        stub = pb_grpc.ClipdStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        with Client(f"127.0.0.1:{port}", message_bytes=32 << 10, max_message_bytes=1 << 20) as c:
            agg = c.create_aggregation({"x": (1000,)}, l2_norm_clip=1.0)
            big = np.ones((20, 1000), np.float32)  # 80 KB in one message: over the 64 KB limit
            with pytest.raises(grpc.RpcError) as info:
                _submit_raw(stub, [pb.SubmitRequest(aggregation_id=agg, client_id="a", sequence=1,
                                                    chunks=[_chunk(0, big)])])
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            huge = np.ones((40, 1000), np.float32)  # 160 KB batch, chunked: over the 100 KB batch limit
            with pytest.raises(grpc.RpcError) as info:
                _submit_raw(stub, [pb.SubmitRequest(aggregation_id=agg, client_id="a", sequence=1,
                                                    chunks=[_chunk(0, huge[:5], shape=huge.shape)])])
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "the limit is 102400" in info.value.details()
            c.submit(agg, np.ones((3, 1000), np.float32))
            assert c.finalize(agg).examples == 3
    finally:
        server.stop(grace=1.0)


def test_aggregation_lifecycle_and_errors(client):
    with pytest.raises(InvalidArgumentError, match="bound must be >= 0"):
        client.create_aggregation(LAYERS, l2_norm_clip=-1.0)
    with pytest.raises(InvalidArgumentError, match="one bound per layer"):
        client.create_aggregation(LAYERS, policy="per_layer_explicit", layer_clips=[1.0])
    with pytest.raises(InvalidArgumentError, match="unique, non-empty name"):
        client.create_aggregation([("a", (2,)), ("a", (3,))])
    agg = client.create_aggregation(LAYERS, aggregation_id="round-7", l2_norm_clip=1.0)
    assert client.create_aggregation(LAYERS, aggregation_id="round-7", l2_norm_clip=1.0) == agg
    with pytest.raises(AlreadyExistsError):
        client.create_aggregation(LAYERS, aggregation_id="round-7", l2_norm_clip=2.0)
    assert agg in [a.aggregation_id for a in client.list_aggregations()]
    updates = make_updates(5, seed=9)
    client.submit(agg, updates)
    stats = client.stats(agg)
    assert stats.examples == 5 and stats.batches == 1 and [layer.name for layer in stats.layers] == list(LAYERS)
    first = client.finalize(agg)
    second = client.finalize(agg)  # idempotent: the result is kept
    for k in LAYERS:
        np.testing.assert_array_equal(first.sums[k], second.sums[k])
    with pytest.raises(FailedPreconditionError, match="finalized"):
        client.submit(agg, updates, client_id="late")
    assert client.get_aggregation(agg).state == pb.Aggregation.FINALIZED
    client.cancel(agg)
    with pytest.raises(NotFoundError):
        client.stats(agg)


def test_aggregation_limit_is_resource_exhausted():
    server, port = create_server(Settings(**{**TEST_SETTINGS, "max_aggregations": 2}))
    try:
        with Client(f"127.0.0.1:{port}") as c:
            first = c.create_aggregation(LAYERS)
            c.create_aggregation(LAYERS)
            with pytest.raises(ResourceExhaustedError, match="the limit is 2"):
                c.create_aggregation(LAYERS)
            c.cancel(first)
            c.create_aggregation(LAYERS)
    finally:
        server.stop(grace=1.0)


def test_health_and_reflection(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "clipd.v1.Clipd"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in answer.list_services_response.service}
    assert {"clipd.v1.Clipd", "grpc.health.v1.Health"} <= names


def test_token_auth():
    server, port = create_server(Settings(**{**TEST_SETTINGS, "admin_token": "s3cret"}))
    try:
        with Client(f"127.0.0.1:{port}") as anonymous:
            with pytest.raises(UnauthenticatedError):
                anonymous.list_aggregations()
            with pytest.raises(UnauthenticatedError):
                anonymous.stats("x")
        with Client(f"127.0.0.1:{port}", token="wrong") as wrong:
            with pytest.raises(UnauthenticatedError):
                wrong.create_aggregation(LAYERS)
        with Client(f"127.0.0.1:{port}", token="s3cret") as good:
            agg = good.create_aggregation(LAYERS)
            updates = make_updates(3)
            good.submit(agg, updates)
            assert good.finalize(agg).examples == 3
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(grace=1.0)


def test_jax_pytrees_and_single_examples_from_the_client(client):
    import jax.numpy as jnp

    from clipd.client import layers_like

    example = {"dense": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}, "scale": jnp.ones(1)}
    layers = layers_like(example)
    assert [layer.name for layer in layers] == ["dense/bias", "dense/kernel", "scale"]
    agg = client.create_aggregation(layers, l2_norm_clip=1e9)
    rng = np.random.default_rng(12)
    examples = [{"dense": {"kernel": jnp.asarray(rng.standard_normal((3, 2)), jnp.float32),
                           "bias": jnp.asarray(rng.standard_normal(2), jnp.float32)},
                 "scale": jnp.asarray(rng.standard_normal(1), jnp.float32)} for _ in range(7)]
    client.submit(agg, iter(examples))
    result = client.finalize(agg)
    assert result.examples == 7
    np.testing.assert_allclose(result.sums["dense/kernel"], sum(np.asarray(e["dense"]["kernel"]) for e in examples),
                               rtol=1e-5)


def test_graceful_stop_sums_everything_it_accepted():
    server, port = create_server(Settings(**TEST_SETTINGS))
    updates = make_updates(4000, seed=13)
    with Client(f"127.0.0.1:{port}", message_bytes=2048, retry_timeout=0) as c:
        agg = c.create_aggregation(LAYERS, l2_norm_clip=1.0)
        errors = []
        sender = threading.Thread(target=lambda: _collect(errors, c.submit, agg, updates))
        sender.start()
        aggregation = server.registry.get(agg)
        wait_until(lambda: aggregation.stats().examples or not sender.is_alive(), 60, "batches flowing")
        server.stop(grace=2.0)
        sender.join(timeout=60)
    # Every batch the server accepted was summed before the worker stopped.
    assert aggregation.pending == 0
    accepted = aggregation.accepted_batches()
    assert aggregation.stats().batches == accepted > 0


def _collect(errors, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # the stream is cut by the stop: expected
        errors.append(e)
