"""One-message submissions (SubmitOne): the same sums, acknowledgements and exactly-once behaviour as a Submit
stream, through dropped connections and SIGKILL; admission that queues callers and refuses past its queue with
an appointment the Python client keeps; routing straight to a shard's process, and through a forwarding one.

References are float64 numpy (clip by the global norm, then sum), computed here.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time

import grpc
import numpy as np
import pytest
from conftest import ADMIN_TOKEN, TEST_SETTINGS
from helpers import wait_until
from service_helpers import FaultyProxy, ServerProcess, free_port, wait_serving

from clipd import wire
from clipd.client import Client
from clipd.server.app import create_server
from clipd.server.rpc.limits import MAX_RETRY_AFTER, MIN_RETRY_AFTER
from clipd.server.settings import Settings
from clipd.v1 import clipd_pb2 as pb

WIDTH = 4096  # float32: 16 KiB an update
CLIP = 1.0


def _update(seed: int, rows: int = 1) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, WIDTH)) / 40).astype(np.float32)


def _clipped_sum(updates) -> np.ndarray:
    total = np.zeros(WIDTH)
    for update in updates:
        for row in update.astype(np.float64):
            total += row * min(1.0, CLIP / np.linalg.norm(row))
    return total


def _assert_sum(result, updates) -> None:
    expected = _clipped_sum(updates)
    assert result.examples == sum(len(u) for u in updates)
    np.testing.assert_allclose(result.sums["x"], expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


def _one(channel, aggregation: str, client: str, sequence: int, update: np.ndarray, writer: str = "w",
         token: str | None = None) -> pb.SubmitResponse:
    """A raw SubmitOne call (clipd.wire's encoding, as the Python client's)."""
    [message] = wire.submit_batch(aggregation, client, sequence, [update], 1 << 22, writer)
    call = channel.unary_unary(wire.SUBMIT_ONE_METHOD, request_serializer=None,
                               response_deserializer=pb.SubmitResponse.FromString)
    metadata = ((wire.AUTHORIZATION_KEY, wire.BEARER + token),) if token else ()
    return call(message, timeout=30, metadata=metadata)


def _refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value


def test_one_message_and_streamed_submissions_sum_and_acknowledge_alike(server):
    target = f"127.0.0.1:{server.port}"
    updates = [_update(seed, rows=1 + seed % 3) for seed in range(6)]
    with Client(target) as one, Client(target, one_message=False) as streamed:
        agg = one.create_aggregation({"x": (WIDTH,)}, l2_norm_clip=CLIP)
        reports = [(one if k % 2 else streamed).submit(agg, {"x": u}, client_id=f"c{k % 3}")
                   for k, u in enumerate(updates)]
        # Each call acknowledged its examples, whichever path took them; a client's batches numbered on.
        assert [r.examples for r in reports] == [len(u) for u in updates]
        hello = list(grpc.insecure_channel(target).stream_stream(
            wire.SUBMIT_METHOD, request_serializer=None, response_deserializer=pb.SubmitResponse.FromString)(
            iter([wire.submit_request(agg, "c0", 0, [], "probe")]), timeout=30))
        assert hello[0].acknowledged_sequence == hello[0].accepted_sequence == 2  # c0 sent updates 0 and 3
        _assert_sum(one.finalize(agg), updates)


def test_a_resent_batch_is_a_duplicate_and_another_writers_is_told_where_the_client_is(server):
    target = f"127.0.0.1:{server.port}"
    channel = grpc.insecure_channel(target)
    with Client(target) as client:
        agg = client.create_aggregation({"x": (WIDTH,)}, l2_norm_clip=CLIP)
        first = _one(channel, agg, "alice", 1, _update(1), writer="a")
        assert (first.acknowledged_sequence, first.accepted_sequence, first.client_id) == (1, 1, "alice")
        again = _one(channel, agg, "alice", 1, _update(1), writer="a")  # its answer was lost: sent again
        assert again.acknowledged_sequence == 1
        error = _refusal(lambda: _one(channel, agg, "alice", 1, _update(2), writer="b"))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "number this one 2" in error.details()
        assert dict(error.trailing_metadata())[wire.ACCEPTED_SEQUENCE_KEY] == "1"
        skipped = _refusal(lambda: _one(channel, agg, "alice", 3, _update(2), writer="b"))
        assert skipped.code() == grpc.StatusCode.FAILED_PRECONDITION and "batch 3 after 1" in skipped.details()
        assert client.stats(agg).examples == 1
        with Client(target) as other:  # another client object, same client id: renumbered after the server's 1
            report = other.submit(agg, {"x": _update(3)}, client_id="alice")
        assert report.examples == 1
        assert _one(channel, agg, "alice", 3, _update(4), writer="c").acknowledged_sequence == 3
        _assert_sum(client.finalize(agg), [_update(1), _update(3), _update(4)])


def test_a_batch_that_does_not_fit_one_message_is_refused_and_changes_nothing(server):
    target = f"127.0.0.1:{server.port}"
    channel = grpc.insecure_channel(target)
    with Client(target) as client:
        agg = client.create_aggregation({"x": (WIDTH,)}, l2_norm_clip=CLIP)
        update = _update(5)
        [first, _] = wire.submit_batch(agg, "bob", 1, [update], WIDTH * 2, "w")  # half of the tensor each
        call = channel.unary_unary(wire.SUBMIT_ONE_METHOD, request_serializer=None)
        error = _refusal(lambda: call(first, timeout=30))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "whole batch in one message" in error.details()
        bad = _refusal(lambda: call(b"\xff\xff\xff", timeout=30))
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert client.stats(agg).examples == 0 and server.servicer.budget.used == 0
        # The refused batch was not accepted: the same number goes through now, whole.
        assert _one(channel, agg, "bob", 1, update).acknowledged_sequence == 1
        # A large update goes on a stream by itself.
        large = _update(6, rows=40)  # 640 KiB > message_bytes
        with Client(target, message_bytes=256 << 10) as small:
            assert small.submit(agg, {"x": large}, client_id="carol").examples == 40
        _assert_sum(client.finalize(agg), [update, large])


def test_dropped_connections_count_each_one_message_submission_once(server):
    proxy = FaultyProxy(server.port, faults=12, min_bytes=300, max_bytes=60_000, seed=3)
    updates = [_update(100 + k) for k in range(24)]
    try:
        with Client(f"127.0.0.1:{server.port}") as admin:
            agg = admin.create_aggregation({"x": (WIDTH,)}, l2_norm_clip=CLIP)
        reports = []
        with Client(f"127.0.0.1:{proxy.port}", retry_delay=0.01) as client:
            for k, update in enumerate(updates):
                reports.append(client.submit(agg, {"x": update}, client_id=f"device-{k % 8}"))
        assert proxy.cuts == 12 and sum(r.reconnects for r in reports) >= 1
        with Client(f"127.0.0.1:{server.port}") as admin:
            _assert_sum(admin.finalize(agg), updates)
    finally:
        proxy.close()


def test_roles_on_submit_one(auth_server):
    target = f"127.0.0.1:{auth_server.port}"
    channel = grpc.insecure_channel(target)
    with Client(target, token=ADMIN_TOKEN) as admin:
        agg = admin.create_aggregation({"x": (WIDTH,)}, l2_norm_clip=CLIP)
        other = admin.create_aggregation({"x": (WIDTH,)}, l2_norm_clip=CLIP)
        own_token = admin.get_aggregation(agg).submit_token
        other_token = admin.get_aggregation(other).submit_token
        alice = admin.client_token("alice", aggregation=agg)
        for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED), ("forged", grpc.StatusCode.UNAUTHENTICATED),
                            (other_token, grpc.StatusCode.PERMISSION_DENIED)):
            error = _refusal(lambda token=token: _one(channel, agg, "x", 1, _update(7), token=token))
            assert error.code() == code, (token, error)
        # A client token speaks for its client only: another name is refused, its own is taken.
        error = _refusal(lambda: _one(channel, agg, "mallory", 1, _update(7), token=alice))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert _one(channel, agg, "", 1, _update(7), token=alice).client_id == "alice"
        assert _one(channel, agg, "bob", 1, _update(8), token=own_token).acknowledged_sequence == 1
        _assert_sum(admin.finalize(agg), [_update(7), _update(8)])


def test_a_full_queue_refuses_with_appointments_within_bounds_that_the_client_keeps():
    """One worker and a queue of one; each call holds its worker until a checkpoint (every 1.5 s) makes it
    durable. Two calls are held (one running, one waiting); the rest are refused with appointments."""
    settings = Settings(**{**TEST_SETTINGS, "data_dir": tempfile.mkdtemp(prefix="clipd-admission-"),
                           "max_streams": 1, "one_message_queue": 1, "checkpoint_interval": 1.5})
    server, port = create_server(settings)
    target = f"127.0.0.1:{port}"
    try:
        channel = grpc.insecure_channel(target)
        with Client(target) as admin:
            agg = admin.create_aggregation({"x": (WIDTH,)}, l2_norm_clip=CLIP)
            admin.submit(agg, {"x": _update(0)}, client_id="warm")
        held = [threading.Thread(target=_one, args=(channel, agg, f"held-{k}", 1, _update(10 + k))) for k in range(2)]
        for thread in held:
            thread.start()
        admission = server.servicer.admission
        wait_until(lambda: admission.held == 2, 10, "two one-message calls held")
        hints = []
        for k in range(4):
            error = _refusal(lambda k=k: _one(channel, agg, f"refused-{k}", 1, _update(20 + k)))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            hints.append(wire.retry_after(error.trailing_metadata()))
        assert all(MIN_RETRY_AFTER <= h <= MAX_RETRY_AFTER for h in hints), hints
        assert all(later > earlier for earlier, later in zip(hints, hints[1:])), hints  # appointments, in turn
        started = time.monotonic()
        with Client(target, retry_delay=0.001) as client:  # refused too: it waits its appointment, then is taken
            report = client.submit(agg, {"x": _update(30)}, client_id="patient")
        assert report.reconnects >= 1
        assert time.monotonic() - started >= hints[-1]  # its own appointment came after the last one above
        for thread in held:
            thread.join(30)
        assert admission.refused >= 5
        load = server.snapshot().load  # what /metrics and /api/v1/server show
        assert (load.refused_one_message, load.one_message_limit) == (admission.refused, 2)
        _assert_sum(admin_finalize(target, agg), [_update(0), _update(10), _update(11), _update(30)])
    finally:
        server.stop(grace=1.0)


def test_checkpoints_are_spaced_by_the_busy_interval_while_a_crowd_of_calls_is_in_flight():
    """12 clients at once, each holding a worker (two) until a checkpoint makes it durable: while two or more calls
    are in flight, checkpoints start busy_checkpoint_interval (0.25 s) apart, not checkpoint_interval (0.01 s);
    a lone client's calls, one at a time, are answered at the interval."""
    settings = Settings(**{**TEST_SETTINGS, "max_streams": 2, "one_message_queue": 64,
                           "checkpoint_interval": 0.01, "busy_checkpoint_interval": 0.25})
    server, port = create_server(settings)
    target = f"127.0.0.1:{port}"
    admission, starts = server.servicer.admission, []
    save = server.store.save_checkpoint
    server.store.save_checkpoint = lambda *a, **k: (starts.append((time.monotonic(), admission.held)),
                                                    save(*a, **k))[1]
    try:
        channel = grpc.insecure_channel(target)
        with Client(target) as admin:
            agg = admin.create_aggregation({"x": (WIDTH,)}, l2_norm_clip=CLIP)
            admin.submit(agg, {"x": _update(0)}, client_id="warm")
        starts.clear()
        round_ = [threading.Thread(target=_one, args=(channel, agg, f"c{k}", 1, _update(10 + k))) for k in range(12)]
        for thread in round_:
            thread.start()
        for thread in round_:
            thread.join(60)
        # Two workers: up to two calls (the last checkpoint's) may end while one is written; from four held at its
        # start, a crowd is still in flight when its successor is scheduled.
        busy = [later - earlier for (earlier, held), (later, _) in zip(starts, starts[1:]) if held >= 4]
        assert len(busy) >= 3, starts
        assert min(busy) >= 0.25 * 0.95, busy
        lone = []
        for k in range(5):  # one call at a time: its checkpoint comes at the interval
            began = time.monotonic()
            _one(channel, agg, f"lone-{k}", 1, _update(40 + k))
            lone.append(time.monotonic() - began)
        assert sorted(lone)[2] < 0.15, lone
        _assert_sum(admin_finalize(target, agg), [_update(s) for s in (0, *range(10, 22), *range(40, 45))])
    finally:
        server.stop(grace=1.0)


def admin_finalize(target: str, aggregation: str):
    with Client(target) as admin:
        return admin.finalize(aggregation)


def test_shard_processes_take_one_message_submissions_straight_or_forwarded(tmp_path):
    server = ServerProcess(tmp_path / "data", tmp_path / "jax-cache", free_port(),
                           args=("--admin-port", "-1", "--processes", "2"))
    server.start()
    target = f"127.0.0.1:{server.port}"
    try:
        wait_serving(target)  # (both shard processes up: the placement names their endpoints)
        updates = [_update(200 + k) for k in range(16)]
        with Client(target) as client:
            agg = client.create_aggregation({"x": (WIDTH,)}, l2_norm_clip=CLIP)
            placement = client.get_aggregation(agg).placement
            assert placement.shards == 2 and len(set(placement.endpoints)) == 2  # read with the aggregation
            for k, update in enumerate(updates[:8]):  # straight to each client's shard's process
                assert client.submit(agg, {"x": update}, client_id=f"d{k}").examples == 1
            channel = grpc.insecure_channel(target)  # the shared port: half land on the other process
            for k, update in enumerate(updates[8:]):
                assert _one(channel, agg, f"e{k}", 1, update).acknowledged_sequence == 1
            assert _one(channel, agg, "e0", 1, updates[8]).acknowledged_sequence == 1  # a duplicate, forwarded too
            _assert_sum(client.finalize(agg), updates)
    finally:
        server.stop()


def test_sigkill_during_a_round_of_one_message_clients_loses_nothing_and_counts_nothing_twice(tmp_path):
    """24 clients each submit 3 one-message updates (a Client each, its own id) while ``clipd serve`` is killed
    twice at random moments and restarted on the same directory and port."""
    rng = random.Random(11)
    server = ServerProcess(tmp_path / "data", tmp_path / "jax-cache", free_port())
    server.start()
    target = f"127.0.0.1:{server.port}"
    errors: list[Exception] = []
    acknowledged = [0] * 24
    try:
        with Client(target) as admin:
            agg = admin.create_aggregation({"x": (WIDTH,)}, l2_norm_clip=CLIP, aggregation_id="one-message-crash")

        def device(k: int) -> None:
            try:
                with Client(target, retry_delay=0.05, retry_timeout=90) as client:
                    for round_ in range(3):
                        report = client.submit(agg, {"x": _update(1000 * k + round_)}, client_id=f"device-{k}")
                        acknowledged[k] += report.examples
                        time.sleep(rng.uniform(0.0, 0.3))
            except Exception as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=device, args=(k,)) for k in range(24)]
        for thread in threads:
            thread.start()
        for _ in range(2):
            time.sleep(rng.uniform(0.1, 0.6))
            server.kill()
            time.sleep(rng.uniform(0.0, 0.3))
            server.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors, errors
        assert server.kills == 2 and acknowledged == [3] * 24
        with Client(target) as admin:
            _assert_sum(admin.finalize(agg), [_update(1000 * k + r) for k in range(24) for r in range(3)])
    finally:
        server.stop()


def test_a_failed_one_message_submission_resumes_on_a_stream_under_its_number(server):
    """The one-message call fails for good (its deadline passes, and retries are over); ``Client.resume`` sends
    that batch on a stream under the same number and writer: counted once whether or not the failed call was
    taken in."""
    target = f"127.0.0.1:{server.port}"
    with Client(target) as admin:
        agg = admin.create_aggregation({"x": (WIDTH,)}, l2_norm_clip=CLIP)
    with Client(target, retry_timeout=0.0) as hasty:
        hasty.layers(agg)  # (read in time)
        hasty.timeout = 1e-4
        with pytest.raises(Exception) as raised:
            hasty.submit(agg, {"x": _update(40)}, client_id="hasty")
    assert raised.value.progress.acknowledged_examples == 0
    with Client(target) as patient:
        report = patient.resume(raised.value)
    assert (report.examples, report.batches) == (1, 1)
    with Client(target) as later:  # the client goes on after it: its next batch is numbered 2
        assert later.submit(agg, {"x": _update(41)}, client_id="hasty").examples == 1
    _assert_sum(admin_finalize(target, agg), [_update(40), _update(41)])
