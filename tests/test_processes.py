"""``clipd serve --processes N``: shard processes receive, clip and sum; the control process sees no payload.

- 8 routed clients through ``--processes 2`` (a real ``clipd serve``), one shard process
  SIGKILLed mid-stream: it is restarted, its shards restore from their checkpoints, the
  clients resend what was not acknowledged, and the result equals a float64 numpy
  reference (nothing lost, nothing twice). The control process received 0 payload bytes.
- The control process SIGKILLed mid-stream (its shard processes go with it): a new
  ``clipd serve`` on the same data directory starts new shard processes on new ports; the
  clients ask for the placement again and finish, exactly.
- A shard process SIGKILLed during start-up: the server comes up all the same, SERVING.
- One client on 4 forced host devices (one process): its submission spreads over the
  4 shards and steps every device.
- Plain clients (no routing: a raw stub on the public port) reach whichever process the
  kernel picks and are forwarded to the owner; every refusal is the one-process one.
"""

from __future__ import annotations

import doctest
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
import zlib

import grpc
import numpy as np
import pytest
from conftest import TEST_SETTINGS
from helpers import wait_until
from service_helpers import (
    ServerProcess,
    assert_exact_global_clip,
    free_port,
    get_json,
    random_batch,
    submitting,
    wait_serving,
)

from clipd import wire
from clipd.client import Client, FailedPreconditionError, Privacy
from clipd.server import aggregations
from clipd.server.app import create_server
from clipd.server.rpc import limits
from clipd.server.settings import Settings
from clipd.server.shards import launchers, protocol
from clipd.server.summing import devices, memory
from clipd.v1 import clipd_pb2 as pb
from clipd.v1 import clipd_pb2_grpc as pb_grpc

LAYERS = {"w": (64, 16), "b": (16,)}
CLIP = 1.0
ROWS = 32
BATCHES = 8
CLIENTS = [f"client-{i}" for i in range(8)]


def _check_exact(result, clients, batches=BATCHES, rows=ROWS) -> None:
    assert_exact_global_clip(result, clients, range(batches), rows, LAYERS, CLIP)


def _slow_updates(gate: threading.Semaphore):
    def updates(client: str):
        for index in range(BATCHES):
            yield random_batch(client, index, LAYERS, ROWS)
            if index == 1:
                gate.release()
            time.sleep(0.05)  # streams stay open while a process is killed
    return updates


@pytest.fixture(scope="module")
def two_shard_processes(tmp_path_factory):
    """One ``clipd serve --processes 2`` (admin API on) for the tests below that kill its processes, on one data
    directory: a start is three processes importing clipd (~4 s), so a test that needs a running server takes
    the one left by the test before; one that must watch a start of its own stops it first. Each works on
    aggregations of its own and checks counts against what it found (restarts, payload bytes, log lines)."""
    root = tmp_path_factory.mktemp("processes")
    admin_port = free_port()
    server = ServerProcess(root / "data", root / "jax-cache", free_port(),
                           args=("--admin-port", str(admin_port), "--processes", "2", "--max-device-rows", "256"))
    server.admin_port = admin_port
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def processes_server(two_shard_processes):
    """The module's ``--processes 2`` server, SERVING (started if it is not running)."""
    if two_shard_processes.proc is None or two_shard_processes.proc.poll() is not None:
        two_shard_processes.start()
    wait_serving(f"127.0.0.1:{two_shard_processes.port}")
    return two_shard_processes


def test_eight_routed_clients_a_shard_process_killed_mid_stream(processes_server):
    server = processes_server
    target, admin = f"127.0.0.1:{server.port}", f"http://127.0.0.1:{server.admin_port}/api/v1/server"
    found = get_json(admin)["shard_processes"]  # (a server that other tests used: counts from here)
    acknowledged = threading.Semaphore(0)
    with Client(target) as c:
        aggregation = c.create_aggregation(LAYERS, l2_norm_clip=CLIP, aggregation_id="processes")
        placement = c.placement(aggregation)
    assert placement.shards == 2 and len(set(placement.endpoints)) == 2
    with submitting(target, aggregation, CLIENTS, _slow_updates(acknowledged), BATCHES * ROWS,
                    retry_delay=0.05, message_bytes=64 << 10):
        for _ in range(4):
            assert acknowledged.acquire(timeout=60)
        victim = get_json(admin)["shard_processes"][0]
        os.kill(victim["pid"], signal.SIGKILL)  # its streams break; it restarts from its checkpoints

    with Client(target) as c:
        _check_exact(c.finalize(aggregation), CLIENTS)
    view = get_json(admin)
    assert view["payload_bytes_received"] == 0  # the control process never saw a payload byte
    assert [p["restarts"] for p in view["shard_processes"]] == [found[0]["restarts"] + 1, found[1]["restarts"]], view
    assert view["shard_processes"][0]["pid"] != victim["pid"]
    # The shard processes received this test's payload: process 0 restarted in it (all it counts is from here).
    received = [p["payload_bytes"] or 0 for p in view["shard_processes"]]
    assert received[0] > 0 or received[1] > (found[1]["payload_bytes"] or 0), view
    assert view["shard_payload_bytes"] > 0 and len(view["devices"]) == 2, view


def test_the_control_process_killed_mid_stream_clients_follow_the_new_placement(processes_server):
    server = processes_server
    target = f"127.0.0.1:{server.port}"
    acknowledged = threading.Semaphore(0)
    clients = CLIENTS[:4]
    admin = f"http://127.0.0.1:{server.admin_port}/api/v1/server"
    with Client(target) as c:
        aggregation = c.create_aggregation(LAYERS, l2_norm_clip=CLIP, aggregation_id="control-killed")
        assert len(c.placement(aggregation).endpoints) == 2
    before = {p["pid"] for p in get_json(admin)["shard_processes"]}
    with submitting(target, aggregation, clients, _slow_updates(acknowledged), BATCHES * ROWS,
                    retry_delay=0.05, retry_timeout=120, message_bytes=64 << 10):
        for _ in range(2):
            assert acknowledged.acquire(timeout=60)
        server.kill()  # the control process: its shard processes exit when they see it gone
        server.start()
    # New shard processes (their ports may be the old ones: the kernel can hand a port out again while the old
    # process, which bound it with SO_REUSEPORT as gRPC does, is still exiting); the clients followed them.
    assert not before & {p["pid"] for p in get_json(admin)["shard_processes"]}
    with Client(target) as c:
        assert len(c.placement(aggregation).endpoints) == 2
        _check_exact(c.finalize(aggregation), clients)


def test_a_dp_sgd_step_is_one_call_where_shard_processes_sum(processes_server):
    """Step is the control process's (forwarded by the shard process that took the call), and the control sums a
    step's one batch itself, in line, as it sums a buffered stream's: a trainer's steps are one call each, exact,
    with no aggregation left on any process."""
    from clipd.client.dpsgd import DpSgd

    with Client(f"127.0.0.1:{processes_server.port}") as client, \
            DpSgd(client, {"w": (8,)}, l2_norm_clip=1.0, noise_multiplier=0.0, sampling_rate=0.5, dataset_size=4,
                  delta=1e-5) as dp:
        steps = []
        for _ in range(2):
            step = dp.step({"w": np.full((3, 8), 0.25, np.float32)})  # norms 0.71: not clipped
            np.testing.assert_allclose(step.gradient["w"], 3 * 0.25 / 2, rtol=1e-6)
            assert step.seconds["step"] > 0 and step.seconds["finalize"] == 0
            steps.append(step.aggregation_id)
        assert client.steps_in_one_call and len(client.ledger(dp.ledger_id).entries) == 2
        listed = {a.aggregation_id for a in client.list_aggregations()}
        assert steps[1] in listed and steps[0] not in listed  # the step before went with the last one's release
    with Client(f"127.0.0.1:{processes_server.port}") as client:
        deadline = time.monotonic() + 10
        while steps[1] in {a.aggregation_id for a in client.list_aggregations()} and time.monotonic() < deadline:
            time.sleep(0.05)  # (closing drops the last)
        assert steps[1] not in {a.aggregation_id for a in client.list_aggregations()}


def test_a_shard_process_killed_during_start_up(two_shard_processes):
    """... the server comes up all the same, and counts the retry as a restart; then clients that go away on the
    forwarded path (plain streams cancelled after an acknowledgement) each log one INFO line, no traceback."""
    server = two_shard_processes
    port, admin_port = server.port, server.admin_port
    log_start = 0
    if server.proc is not None:  # a start of its own: the module's server, stopped
        server.stop()
        log_start = len(server.log())  # (its log file goes on: this test reads what comes after)
        server.proc = None
    started = threading.Thread(target=server.start)
    started.start()
    killed = None
    deadline = time.monotonic() + 60
    while killed is None and time.monotonic() < deadline:  # the first shard process seen, as soon as it exists
        if server.proc is not None:  # (by its command line: clipd serve also runs ldconfig, ctypes' find_library)
            children = subprocess.run(["pgrep", "-P", str(server.proc.pid), "-f", "clipd.server.shards.host"],
                                      capture_output=True, text=True).stdout.split()
            if children:
                killed = int(children[0])
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.01)
    started.join(120)
    assert killed is not None
    wait_serving(f"127.0.0.1:{port}")
    assert server.proc.poll() is None  # the server did not exit
    with Client(f"127.0.0.1:{port}") as c:
        aggregation = c.create_aggregation(LAYERS, l2_norm_clip=CLIP)
        for client in CLIENTS[:2]:
            c.submit(aggregation, [random_batch(client, i, LAYERS, ROWS) for i in range(BATCHES)],
                     client_id=client)
        _check_exact(c.finalize(aggregation), CLIENTS[:2])
    view = get_json(f"http://127.0.0.1:{admin_port}/api/v1/server")
    assert view["restarts"] >= 1 and sum(p["restarts"] for p in view["shard_processes"]) == view["restarts"]
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=30) as response:
        metrics = response.read().decode()
    assert sum(_metric(metrics, "clipd_shard_process_restarts_total", process=str(i)) for i in (0, 1)) >= 1
    _clients_go_away_on_the_forwarded_path(f"127.0.0.1:{port}", server, log_start)


def _clients_go_away_on_the_forwarded_path(target: str, server: ServerProcess, log_start: int, cuts: int = 12,
                                           rounds: int = 4) -> None:
    """``log_start``: where this server's log begins (its file holds the runs before, too). Streams land on either
    process as the kernel spreads the public port's connections (a shard process restarted a moment ago may not
    take any yet): rounds of ``cuts`` streams until one went through the other process, at most ``rounds``."""

    def log() -> str:
        return server.log()[log_start:]

    def departed() -> bool:
        return "went away mid-stream" in log()

    with Client(target) as c:
        aggregation = c.create_aggregation({"w": (4,)}, l2_norm_clip=1.0)
        token = [("authorization", f"Bearer {c.get_aggregation(aggregation).submit_token}")]
    for attempt in range(rounds):
        for i in range(cuts):
            acknowledged = threading.Event()

            def requests(client=f"gone-{attempt}-{i}", acknowledged=acknowledged):
                chunk = wire.tensor_chunk(0, pb.FLOAT32, (1, 4), 0, np.ones(4, np.float32).view(np.uint8))
                yield wire.submit_request(aggregation, client, 1, [chunk], "w")
                acknowledged.wait(30)
                yield wire.submit_request(aggregation, client, 2, [chunk], "w")  # never sent: cancelled first
            with grpc.insecure_channel(target) as channel:  # the public port: half land on the other process
                call = channel.stream_stream("/clipd.v1.Clipd/Submit",
                                             response_deserializer=pb.SubmitResponse.FromString)(
                    requests(), metadata=token, timeout=30)
                assert any(response.acknowledged_sequence == 1 for response in call)  # (the first: where to resume)
                call.cancel()
                acknowledged.set()
        deadline = time.monotonic() + 10
        while not departed() and time.monotonic() < deadline:
            time.sleep(0.1)
        if departed():
            break
    assert departed(), f"a forwarded client's departure logged: {log()[-3000:]}"
    time.sleep(0.5)  # (what a late traceback would need to reach the log)
    text = log()
    assert "Exception iterating requests" not in text and "Traceback" not in text, text[-5000:]


def test_one_client_spreads_over_four_devices_and_steps_each(tmp_path):
    admin_port = free_port()
    server = ServerProcess(tmp_path / "data", tmp_path / "jax-cache", free_port(),
                           args=("--admin-port", str(admin_port), "--max-device-rows", "64"),
                           env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    server.start()
    target = f"127.0.0.1:{server.port}"
    try:
        with Client(target, message_bytes=64 << 10) as c:
            aggregation = c.create_aggregation(LAYERS, l2_norm_clip=CLIP)
            assert c.placement(aggregation).shards == 4
            report = c.submit(aggregation, (random_batch("solo", i, LAYERS, ROWS) for i in range(BATCHES)),
                              client_id="solo")
            assert report.examples == BATCHES * ROWS and report.batches >= 4
            steps = [d["steps"] for d in get_json(f"http://127.0.0.1:{admin_port}/api/v1/server")["devices"]]
            assert len(steps) == 4 and all(s > 0 for s in steps), steps
            _check_exact(c.finalize(aggregation), ["solo"])
    finally:
        server.stop()


def test_a_placement_names_endpoints_only_once_every_shard_hosts_is_known(monkeypatch):
    """While a shard process starts, its port is not known: the placement then names no endpoint at all (a
    client sends to the shared address, which passes each call on), never an address with port 0."""
    server, port = create_server(Settings(**TEST_SETTINGS))
    try:
        with Client(f"127.0.0.1:{port}") as c:
            aggregation = c.create_aggregation(LAYERS, l2_norm_clip=CLIP)
            known = {"endpoints": ["127.0.0.1:5001", ""]}
            monkeypatch.setattr(server.devices, "endpoints", lambda: known["endpoints"])
            assert c.get_aggregation(aggregation).placement.endpoints == []  # one still starting
            known["endpoints"] = ["127.0.0.1:5001", "127.0.0.1:5002"]
            c._forget_placement(aggregation)
            assert list(c.placement(aggregation).endpoints) == ["127.0.0.1:5001"]  # (its one shard's host)
    finally:
        server.stop(grace=0.5)


def test_the_doctests_of_the_data_plane_modules():
    # (the placement rule's doctests are clipd.wire's: tests/test_wire.py); protocol: adding the processes' loads
    for module in (limits, memory, launchers, protocol):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_spread_ids_land_on_successive_shards():
    base = zlib.crc32(b"solo") % 4  # the rule from its definition, not from clipd
    assert [wire.shard_of(i, 4) for i in ("solo", "solo~1", "solo~2", "solo~3")] == [
        base, (base + 1) % 4, (base + 2) % 4, (base + 3) % 4]
    assert wire.shard_of("a~b", 4) == wire.shard_of("a~b", 4)  # not a stream number: a plain id


@pytest.fixture(scope="module")
def behind_shards(tmp_path_factory):
    """Two shard processes (the control in this process) with an admin token: every role boundary crossed."""
    data = tmp_path_factory.mktemp("shards")
    server, port = create_server(Settings(**{**TEST_SETTINGS, "processes": 2, "admin_token": "admin-secret",
                                             "data_dir": str(data), "admin_port": 0}))
    yield server, f"127.0.0.1:{port}"
    server.stop(1.0)


def test_refusals_through_a_shard_process_are_those_of_one_process(behind_shards):
    server, target = behind_shards
    admin = [("authorization", "Bearer admin-secret")]
    with Client(target, token="admin-secret") as c:
        c.create_aggregation({"w": (4,)}, l2_norm_clip=1.0, aggregation_id="via-shards")
        created = c.get_aggregation("via-shards")
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
        with pytest.raises(grpc.RpcError) as e:  # no token at all
            list(raw(iter([wire.submit_request("via-shards", "x", 0, [], "w")]), timeout=30))
        assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:  # the placement needs a credential of the aggregation
            stub.GetPlacement(pb.GetPlacementRequest(aggregation_id="via-shards"), timeout=30,
                              metadata=[("authorization", "Bearer forged")])
        assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
        placement = stub.GetPlacement(pb.GetPlacementRequest(aggregation_id="via-shards"), timeout=30,
                                      metadata=[("authorization", f"Bearer {created.submit_token}")])
        assert placement.shards == 2 and list(placement.endpoints) == server.devices.endpoints()  # answered there
        with pytest.raises(grpc.RpcError) as e:
            stub.GetPlacement(pb.GetPlacementRequest(aggregation_id="nope"), metadata=admin, timeout=30)
        assert e.value.code() is grpc.StatusCode.NOT_FOUND

    # Plain (unrouted) streams on the public port, for clients of both shards: each lands on either process
    # and is forwarded to its owner when need be; the sum is exact.
    x = {c: np.arange(12, dtype=np.float32).reshape(3, 4) / (10 + i) for i, c in enumerate("abcdef")}
    token = [("authorization", f"Bearer {created.submit_token}")]
    assert {aggregations.shard_of(c, 2) for c in x} == {0, 1}
    for client, values in x.items():
        with grpc.insecure_channel(target) as channel:
            raw = channel.stream_stream("/clipd.v1.Clipd/Submit", response_deserializer=pb.SubmitResponse.FromString)
            chunk = wire.tensor_chunk(0, pb.FLOAT32, values.shape, 0, values.reshape(-1).view(np.uint8))
            acks = list(raw(iter([wire.submit_request("via-shards", client, 1, [chunk], "w")]), metadata=token,
                            timeout=60))
            assert acks[-1].acknowledged_sequence == 1
    with Client(target, token="admin-secret") as c:
        # The control's statistics, polled from the shard processes.
        wait_until(lambda: c.stats("via-shards").examples == 18, 10,
                   lambda: f"18 examples in the statistics ({c.stats('via-shards')})", step=0.1)
        # ... the hosts' reports, read-only in the control (HostedAggregation): the clients they saw, the batches,
        # and the throughput series counted from their reports (every example in some second).
        assert c.stats("via-shards").batches == 6
        aggregation = server.aggregation("via-shards")
        assert server.stats(aggregation).clients == 6  # (what the admin API shows)
        assert sum(n for _, n in server.throughput(aggregation)[0]) == 18
        assert aggregation.stats().examples == 0  # (the control sums nothing: its own totals stay empty)
        result = c.finalize("via-shards")
        server.devices.forget(aggregation)  # (what the hosts are told once it is finalized): its series stays
        assert sum(n for _, n in server.throughput(aggregation)[0]) == 18
    with grpc.insecure_channel(target) as channel:  # finalized: every shard process refuses more batches
        raw = channel.stream_stream("/clipd.v1.Clipd/Submit")
        for client in x:
            chunk = wire.tensor_chunk(0, pb.FLOAT32, (1, 4), 0, np.zeros(4, np.float32).view(np.uint8))
            with pytest.raises(grpc.RpcError) as e:
                list(raw(iter([wire.submit_request("via-shards", client, 2, [chunk], "w")]), metadata=token,
                         timeout=60))
            assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
    stacked = np.concatenate(list(x.values())).astype(np.float64)
    norms = np.linalg.norm(stacked, axis=1)
    np.testing.assert_allclose(result.sums["w"], np.minimum(1, 1 / norms) @ stacked, rtol=1e-6)
    assert result.examples == 18
    assert server.servicer.payload_bytes == 0
    assert all(p["alive"] for p in server.hosts.describe_processes())


def test_a_silent_stream_on_a_shard_process_is_closed_after_the_idle_timeout(tmp_path):
    """A stream that never sends its first message holds a slot (evictable) and is closed, UNAVAILABLE, in time."""
    # An idle timeout of 1 s (it was 2 s: what is checked is that the stream is closed after it, not before).
    server, port = create_server(Settings(**{**TEST_SETTINGS, "processes": 1, "data_dir": str(tmp_path / "data"),
                                             "stream_idle_timeout": 1.0, "buffer_wait": 0.5}))
    try:
        release = threading.Event()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            raw = channel.stream_stream("/clipd.v1.Clipd/Submit")
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                list(raw(iter(lambda: release.wait(30) and b"", None), timeout=30))  # sends nothing
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE and "nothing received" in e.value.details()
            assert 0.75 < time.monotonic() - started < 10
        release.set()
    finally:
        server.stop(1.0)



def _admin(server, path: str) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{server.admin.port}{path}",
                                     headers={"Authorization": "Bearer admin-secret"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()


def _metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of ``/metrics`` text (None: no such sample)."""
    wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_every_shard_process_is_counted_in_metrics_readyz_and_the_server_view(behind_shards):
    """N streams held open, each on the shard process that owns its shard: /metrics, /readyz and /api/v1/server
    count N, and say how many each process has; a malformed stream refused by a shard process is counted in the
    server's refusals and in that process's."""
    server, target = behind_shards
    with Client(target, token="admin-secret") as c:
        c.create_aggregation({"w": (4,)}, l2_norm_clip=1.0, aggregation_id="held-open")
        created = c.get_aggregation("held-open")
    token = [("authorization", f"Bearer {created.submit_token}")]
    endpoints = server.devices.endpoints()
    clients = [f"held-{i}" for i in range(7)]
    owners = [devices.owner_of(aggregations.shard_of(c, 2), 2) for c in clients]
    assert set(owners) == {0, 1}
    release = threading.Event()
    acknowledged = threading.Semaphore(0)
    calls = []

    def held(client: str):  # one batch, then nothing until released (the stream stays open)
        chunk = wire.tensor_chunk(0, pb.FLOAT32, (1, 4), 0, np.ones(4, np.float32).view(np.uint8))
        yield wire.submit_request("held-open", client, 1, [chunk], "w")
        release.wait(60)

    channels = [grpc.insecure_channel(endpoints[owner]) for owner in owners]
    try:
        for client, channel in zip(clients, channels):
            call = channel.stream_stream("/clipd.v1.Clipd/Submit", response_deserializer=pb.SubmitResponse.FromString)(
                held(client), metadata=token, timeout=60)
            calls.append(call)
            threading.Thread(target=lambda call=call: (next(call), acknowledged.release()), daemon=True).start()
        for _ in clients:
            assert acknowledged.acquire(timeout=30)
        per_process = {i: owners.count(i) for i in (0, 1)}

        def counted() -> bool:
            view = json.loads(_admin(server, "/api/v1/server"))
            return view["streams"]["active"] == len(clients) and all(
                p["streams"] and p["streams"]["active"] == per_process[p["index"]] for p in view["shard_processes"])

        wait_until(counted, 10, lambda: f"{len(clients)} streams counted: {_admin(server, '/api/v1/server')}",
                   step=0.1)
        wait_until(lambda: json.loads(_admin(server, "/api/v1/aggregations/held-open"))["clients"] == len(clients),
                   10, lambda: f"{len(clients)} clients: {_admin(server, '/api/v1/aggregations/held-open')}", step=0.1)
        metrics = _admin(server, "/metrics")
        assert _metric(metrics, "clipd_active_streams") == len(clients)
        for index, count in per_process.items():
            assert _metric(metrics, "clipd_shard_process_active_streams", process=str(index)) == count
            assert _metric(metrics, "clipd_shard_process_up", process=str(index)) == 1
        limit = _metric(metrics, "clipd_stream_limit")
        assert limit == 2 * server.settings.max_streams
        ready = json.loads(_admin(server, "/readyz"))
        assert ready["streams"] == {"active": len(clients), "limit": limit}
        assert [p["streams"]["active"] for p in ready["processes"]] == [per_process[0], per_process[1]]
    finally:
        release.set()
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()

    def rejected(text: str, **labels) -> float:
        return _metric(text, "clipd_rejected_requests_total", code="INVALID_ARGUMENT") or 0.0 if not labels else \
            _metric(text, "clipd_shard_process_rejected_requests_total", code="INVALID_ARGUMENT", **labels) or 0.0

    before = _admin(server, "/metrics")
    with grpc.insecure_channel(endpoints[1]) as channel:  # bytes that are no SubmitRequest, to shard process 1
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as e:
                list(channel.stream_stream("/clipd.v1.Clipd/Submit")(iter([b"\xff\xff"]), metadata=token,
                                                                     timeout=30))
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    wait_until(lambda: rejected(_admin(server, "/metrics")) == rejected(before) + 3, 10,
               lambda: f"3 more INVALID_ARGUMENT refusals counted in: {_admin(server, '/metrics')}", step=0.1)
    after = _admin(server, "/metrics")
    assert rejected(after, process="1") == rejected(before, process="1") + 3
    assert rejected(after, process="0") == rejected(before, process="0")
    view = json.loads(_admin(server, "/api/v1/server"))
    assert view["rejections"]["INVALID_ARGUMENT"] == rejected(after)


def test_the_dashboard_signed_in_shows_each_shard_process(behind_shards, tmp_path):
    """A real browser signs in through the login form (the token posted to /login: a session cookie) and the
    dashboard's server panel shows each shard process as /api/v1/server has it."""
    from test_dashboard import Dom, chromium_flags

    server, _ = behind_shards
    base = f"http://127.0.0.1:{server.admin.port}"
    sign_in = ("data:text/html,<form method=post action='" + base + "/login'>"
               "<input name=token value=admin-secret></form><script>document.forms[0].submit()</script>")
    page = subprocess.run([*chromium_flags(tmp_path / "profile"), "--dump-dom", sign_in], capture_output=True,
                          text=True, timeout=120).stdout
    api = json.loads(_admin(server, "/api/v1/server"))
    panel = Dom(page).root.one(id="server")
    assert len(api["shard_processes"]) == 2
    for process in api["shard_processes"]:
        row = panel.one(data_process=str(process["index"]))
        for column in ("restarts", "streams.limit", "pid"):
            value = process
            for key in column.split("."):
                value = value[key]
            assert row.one(data_col=column).attrs["data-value"] == str(value), (column, row.attrs)
    assert float(panel.one(data_server="streams.limit").attrs["data-value"]) == api["streams"]["limit"]


def test_the_servers_draws_hold_at_the_shard_processes(behind_shards):
    """A ledger whose sampling the server draws (q = 0.5, z = 0: the sum exact), behind two shard processes: a
    client the server did not draw is refused where its stream lands (a shard process draws with the control's
    key, from the shared store), and the release is the drawn clients' updates alone."""
    server, target = behind_shards
    privacy = Privacy(f"drawn-{uuid.uuid4().hex[:8]}", 1e-5, noise_multiplier=0.0, sampling="poisson",
                      sampling_rate=0.5, drawn_by="server")
    update = {"w": np.full((1, 4), 0.1, np.float32)}
    with Client(target, token="admin-secret") as c:
        wait_serving(target)
        aggregation = c.create_aggregation({"w": (4,)}, l2_norm_clip=1.0, privacy=privacy, unit="client")
        candidates = [f"s{i}" for i in range(16)]
        drawn = c.draw_clients(aggregation, candidates)
        left_out = [site for site in candidates if site not in drawn]
        assert drawn and left_out
        for site in left_out:
            with pytest.raises(FailedPreconditionError, match="not drawn for this release"):
                c.submit(aggregation, update, client_id=site)
        for site in drawn:
            c.submit(aggregation, update, client_id=site)
        result = c.finalize(aggregation)
    np.testing.assert_allclose(result.sums["w"], 0.1 * len(drawn), rtol=1e-6)


def test_a_buffered_stream_runs_behind_shard_processes(behind_shards):
    """``--processes 2``: contributions to a buffered stream (K = 3, z = 0) reach the control process through
    the shard processes, which sums them (the streams' buffers are summed where the stream decides); each
    release is the exact sum of what was acknowledged into it, a resend counts once, and the buffer refuses a
    direct Submit, Finalize or cancel (through a shard process too), saying to use SubmitToStream."""
    from clipd.client import Buffer

    _, target = behind_shards
    with Client(target, token="admin-secret") as c:
        sid = c.create_stream({"w": (8,)}, l2_norm_clip=1.0, buffer=Buffer(size=3, staleness_exponent=0.0),
                              privacy=Privacy(f"procs-{uuid.uuid4().hex[:8]}", 1e-5, noise_multiplier=0.0,
                                              max_participations=10, min_separation=1))
        rng = np.random.default_rng(3)
        updates = {f"p{i}": (rng.uniform(-0.2, 0.2, 8).astype(np.float32)) for i in range(6)}
        for i, (client, update) in enumerate(updates.items()):
            ack = c.submit_to_stream(sid, {"w": update}, trained_from=0, client_id=client, sequence=1)
            assert (ack.version, ack.duplicate) == (1 + i // 3, False)
        again = c.submit_to_stream(sid, {"w": updates["p0"]}, trained_from=0, client_id="p0", sequence=1)
        assert (again.version, again.duplicate) == (1, True)
        releases = [r for _, r in zip(range(2), c.watch_releases(sid, after=0, timeout=60))]
        for release, clients in zip(releases, (["p0", "p1", "p2"], ["p3", "p4", "p5"])):
            expected = sum(updates[k].astype(np.float64) for k in clients)
            np.testing.assert_allclose(release.sums["w"], expected, rtol=1e-6, atol=1e-7)
            assert release.release.contributions == 3
        buffer = f"{sid}.v3"
        for act in (lambda: c.submit(buffer, {"w": np.zeros((1, 8), np.float32)}, client_id="x"),
                    lambda: c.finalize(buffer), lambda: c.cancel(buffer)):
            with pytest.raises(FailedPreconditionError, match="go through SubmitToStream"):
                act()
        assert c.stream(sid).state == "open"
