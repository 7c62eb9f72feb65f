"""``clipd serve --processes N``: ingest processes on one port, forwarding through shared memory.

- 8 clients through ``--processes 2`` (a real ``clipd serve`` process), one ingest
  process killed with SIGKILL mid-stream: the clients reconnect, the server
  restarts the ingest process, and the result equals a float64 numpy reference
  (``service_helpers``) (nothing lost, nothing twice); both ingest processes forwarded calls.
- Behind one ingest process, every refusal is the single-process one: bad bytes,
  a missing or wrong token, an unknown aggregation; auth still holds.
- The shared-memory ring: a region is reused only once the server has dropped
  every view of it; segment names and offsets from the wire are checked.
"""

from __future__ import annotations

import doctest
import gc
import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from clipd.client import Client
from clipd.server import aggregations, ingest, wire
from clipd.server.app import create_server
from clipd.server.settings import Settings
from clipd.v1 import clipd_pb2 as pb
from clipd.v1 import clipd_pb2_grpc as pb_grpc
from conftest import TEST_SETTINGS
from service_helpers import ServerProcess, free_port, get_json, global_clip_reference, random_batch, submitting

LAYERS = {"w": (64, 16), "b": (16,)}
CLIP = 1.0
ROWS = 32
BATCHES = 8
CLIENTS = [f"client-{i}" for i in range(8)]


def test_eight_clients_through_two_ingest_processes_one_killed_mid_stream(tmp_path):
    admin_port = free_port()
    server = ServerProcess(tmp_path / "data", tmp_path / "jax-cache", free_port(),
                           args=("--admin-port", str(admin_port), "--processes", "2", "--max-device-rows", "256"))
    server.start()
    target, admin = f"127.0.0.1:{server.port}", f"http://127.0.0.1:{admin_port}/api/v1/server"
    acknowledged = threading.Semaphore(0)
    try:
        with Client(target) as c:
            aggregation = c.create_aggregation(LAYERS, l2_norm_clip=CLIP, aggregation_id="processes")

        def updates(client: str):
            for index in range(BATCHES):
                yield random_batch(client, index, LAYERS, ROWS)
                if index == 1:
                    acknowledged.release()
                time.sleep(0.05)  # streams stay open while an ingest process is killed

        with submitting(target, aggregation, CLIENTS, updates, BATCHES * ROWS, retry_delay=0.05,
                        message_bytes=64 << 10):
            for _ in range(4):
                assert acknowledged.acquire(timeout=60)
            victim = get_json(admin)["ingest_processes"][0]
            os.kill(victim["pid"], signal.SIGKILL)  # streams through it break: their clients reconnect

        with Client(target) as c:
            result = c.finalize(aggregation)
        sums, clipped, examples = global_clip_reference(
            [random_batch(c, i, LAYERS, ROWS) for c in CLIENTS for i in range(BATCHES)], CLIP)
        assert result.examples == examples == len(CLIENTS) * BATCHES * ROWS
        assert result.clip_counts == {"w": clipped, "b": clipped}
        for name in LAYERS:
            np.testing.assert_allclose(result.sums[name], sums[name], rtol=1e-5, atol=1e-5 * np.abs(sums[name]).max())

        deadline = time.monotonic() + 60  # the server notices within 0.2 s; a new interpreter takes seconds
        while [p["restarts"] for p in get_json(admin)["ingest_processes"]] != [1, 0]:
            assert time.monotonic() < deadline, (get_json(admin), server.log()[-3000:])
            time.sleep(0.2)
        processes = get_json(admin)["ingest_processes"]
        assert all(p["alive"] for p in processes) and processes[0]["pid"] != victim["pid"]
        for _ in range(64):  # each new connection lands on either process; both must forward
            if all(p["calls"] > 0 for p in get_json(admin)["ingest_processes"]):
                break
            with grpc.insecure_channel(target) as channel:
                pb_grpc.ClipdStub(channel).ListAggregations(pb.ListAggregationsRequest(), timeout=30)
        assert all(p["calls"] > 0 for p in get_json(admin)["ingest_processes"])
    finally:
        server.stop()


@pytest.fixture(scope="module")
def behind_ingest():
    """A server with one ingest process and an admin token (so every role boundary is crossed through it)."""
    server, port = create_server(Settings(**{**TEST_SETTINGS, "processes": 1, "admin_token": "admin-secret"}))
    yield server, f"127.0.0.1:{port}"
    server.stop(1.0)


def test_refusals_through_an_ingest_process_are_those_of_one_process(behind_ingest):
    server, target = behind_ingest
    admin = [("authorization", "Bearer admin-secret")]
    with Client(target, token="admin-secret") as c:
        c.create_aggregation({"w": (4,)}, l2_norm_clip=1.0, aggregation_id="via-ingest")
        created = c.get_aggregation("via-ingest")
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ClipdStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.ListAggregations(pb.ListAggregationsRequest(), timeout=30)
        assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:  # a submit token may not list
            stub.ListAggregations(pb.ListAggregationsRequest(), timeout=30,
                                  metadata=[("authorization", f"Bearer {created.submit_token}")])
        assert e.value.code() is grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as e:
            stub.GetStats(pb.GetStatsRequest(aggregation_id="nope"), metadata=admin, timeout=30)
        assert e.value.code() is grpc.StatusCode.NOT_FOUND and "nope" in e.value.details()
        raw = channel.stream_stream("/clipd.v1.Clipd/Submit")
        with pytest.raises(grpc.RpcError) as e:  # bytes that are no SubmitRequest
            list(raw(iter([b"\xff\xff\xff"]), metadata=admin, timeout=30))
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "malformed" in e.value.details()

    with Client(target, token=created.submit_token) as c:  # and a real submission, exact
        x = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
        c.submit("via-ingest", {"w": x}, client_id="a")
    with Client(target, token="admin-secret") as c:
        result = c.finalize("via-ingest")
    norms = np.linalg.norm(x.astype(np.float64), axis=1)
    np.testing.assert_allclose(result.sums["w"], (np.minimum(1, 1 / norms) @ x), rtol=1e-6)
    assert server.ingest.describe()[0]["alive"]


def test_a_region_is_reused_only_after_every_view_of_it_is_gone(tmp_path):
    arena = ingest.Arena(str(tmp_path), "ingest-3-1", 8 * ingest.HEADER)
    regions = ingest.SharedRegions(str(tmp_path))
    first = arena.put(b"a" * 100, wait=0)
    view = regions.view(*first)
    array = np.frombuffer(view, np.uint8)[10:20]  # a view of a view keeps the region too
    del view
    gc.collect()
    second = arena.put(b"b" * 100, wait=0)
    assert second[1] != first[1]
    with pytest.raises(Exception, match="waited 0 s"):  # 2 x (64 + 128) of 512 bytes in use
        arena.put(b"c" * 200, wait=0)
    assert bytes(array) == b"a" * 10  # not overwritten
    del array
    gc.collect()
    third = arena.put(b"c" * 100, wait=0)  # the first region is free again
    assert third[1] == first[1]
    assert bytes(regions.view(*third)) == b"c" * 100


def test_references_are_checked_and_a_stale_or_forged_one_reads_nothing(tmp_path):
    arena = ingest.Arena(str(tmp_path), "ingest-3-1", 8 * ingest.HEADER)
    regions = ingest.SharedRegions(str(tmp_path))
    segment, offset, length, tag = arena.put(b"x" * 8, wait=0)
    for bad in [("../etc/passwd", 0, 1, tag), (segment, 1, 1, tag), (segment, 0, 10**9, tag),
                (segment, 128, 1, tag), (segment, offset, length, tag ^ 1)]:  # the last: the wrong tag
        with pytest.raises(ValueError, match="shared chunk"):
            regions.view(*bad)
    view = regions.view(segment, offset, length, tag)
    with pytest.raises(ValueError, match="not in use by this reference"):  # read once only
        regions.view(segment, offset, length, tag)
    assert regions.release([(segment, offset, length, tag)]) == 0  # read: not the release's to free
    assert bytes(view) == b"x" * 8
    del view
    gc.collect()
    again = arena.put(b"y" * 8, wait=0)  # the same place, a new tag: the old reference is stale
    assert again[1] == offset and again[3] != tag
    with pytest.raises(ValueError, match="not in use by this reference"):
        regions.view(segment, offset, length, tag)


def test_regions_of_a_call_the_server_never_read_come_back(tmp_path):
    arena = ingest.Arena(str(tmp_path), "ingest-3-1", 4 * ingest.HEADER)
    regions = ingest.SharedRegions(str(tmp_path))
    read, unread = arena.put(b"a", wait=0), arena.put(b"b", wait=0)
    view = regions.view(*read)
    assert arena.unread([read, unread]) == [unread]
    assert regions.release(arena.unread([read, unread])) == 1
    del view
    gc.collect()
    assert arena.used == 0  # both free: the ring is empty


def test_streams_the_server_cut_short_leave_no_region_in_use(behind_ingest):
    """A gap, a malformed message and a finalized aggregation end calls early: every region comes back."""
    server, target = behind_ingest
    with Client(target, token="admin-secret") as c:
        c.create_aggregation({"w": (1024,)}, l2_norm_clip=1.0, aggregation_id="cut-short")
        token = c.get_aggregation("cut-short").submit_token
    x = np.ones((4, 1024), np.float32).tobytes()

    def message(sequence: int) -> bytes:
        return pb.SubmitRequest(aggregation_id="cut-short", client_id="a", sequence=sequence, chunks=[
            pb.TensorChunk(layer=0, dtype=pb.FLOAT32, shape=[4, 1024], data=x)]).SerializeToString()

    with grpc.insecure_channel(target) as channel:
        raw = channel.stream_stream("/clipd.v1.Clipd/Submit")
        metadata = [("authorization", f"Bearer {token}")]
        with pytest.raises(grpc.RpcError) as e:  # 1, then a gap: the server stops reading what follows
            list(raw(iter([message(1), message(3)] + [message(4 + k) for k in range(20)]), metadata=metadata,
                     timeout=30))
        assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "after 1" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(raw(iter([message(2), b"\x0a\xff"]), metadata=metadata, timeout=30))
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    (segment,) = [f for f in os.listdir(server._arena_dir) if f.startswith("ingest-")]
    deadline = time.monotonic() + 10
    while True:
        with open(os.path.join(server._arena_dir, segment), "rb") as f:
            ring = f.read()
        states, offset = [], 0
        while offset < len(ring):  # walk the regions from the start
            state, size, _ = ingest._HEAD.unpack_from(ring, offset)
            if size == 0:
                break
            states.append(state)
            offset += size
        if not {ingest.IN_USE, ingest.READ} & set(states):
            break
        assert time.monotonic() < deadline, states
        gc.collect()
        time.sleep(0.1)


def test_the_module_doctests():
    for module in (ingest, wire, aggregations):
        assert doctest.testmod(module).failed == 0, module.__name__
