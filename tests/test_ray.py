"""Shard actors on a local two-node Ray cluster, checkpointing to a throwaway PostgreSQL (clipd/server/shards/ray_actors.py).

- ShardOwner alone (no Ray) on a PostgresStore: duplicates, gaps, restore, fencing.
- A shard actor SIGKILLed mid-stream (after a commit, and with a call in flight) is restarted by
  Ray, restores from the store, the driver resends, and every batch is counted once.
- A stale owner (SIGSTOPped actor) is fenced out by its replacement: its commit is refused and
  the replacement's checkpoint is the one in the store.

The reference is a float64 numpy global-L2 clip written here (not clipd's code): the sums match
it to float32 accuracy, the counts exactly; the interrupted runs match an uninterrupted run of
ShardOwner in this process bit for bit (each batch is its own jitted step).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest

import ray  # noqa: E402  (the [test] extra installs it: a missing Ray fails, it is not skipped)
import ray.cluster_utils  # noqa: E402

from clipd.engine import LayerSpec, PartialState  # noqa: E402
from clipd.engine._policy import ClipPolicy  # noqa: E402
from clipd.server.aggregations import spec_to_json  # noqa: E402
from clipd.server.stores.postgres import PostgresStore  # noqa: E402
from clipd.server.shards.ray_actors import FencedOut, ShardOwner, call_until_answered, shard_actor  # noqa: E402
from clipd.server.stores.base import AggregationRecord, MemoryStore  # noqa: E402

from test_postgres_store import pg_cluster  # noqa: E402,F401  (a fixture)

CLIP = 1.0
LAYERS = (LayerSpec("w", (4, 3), "float32"), LayerSpec("b", (5,), "float32"))
SPEC = spec_to_json(LAYERS, ClipPolicy(l2_norm_clip=CLIP), False, shards=2)
ROWS = 8
GET_TIMEOUT = 60

# Ray starts its node processes with subprocess (fork + exec) after JAX is imported here: harmless.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")


# Fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pg(pg_cluster):
    """The throwaway PostgreSQL of tests/test_postgres_store.py."""
    return pg_cluster


@pytest.fixture(scope="module")
def ray_cluster():
    """Two Ray nodes with one CPU each (a shard actor asks for half a CPU)."""
    node_args = dict(num_cpus=1, object_store_memory=100 << 20)
    cluster = ray.cluster_utils.Cluster(
        initialize_head=True, head_node_args=dict(node_args, include_dashboard=False))
    try:
        cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


# Data and the reference -----------------------------------------------------------------------
def batch(seed: int) -> list[np.ndarray]:
    """ROWS examples; norms spread around CLIP so that some are clipped and some are not."""
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.05, 0.6, size=(ROWS, 1))
    return [(rng.normal(size=(ROWS, *layer.shape)) * scale.reshape((ROWS,) + (1,) * len(layer.shape)))
            .astype(np.float32) for layer in LAYERS]


def reference(batches: list[list[np.ndarray]]) -> tuple[list[np.ndarray], int, int]:
    """Global L2 clipping in float64: sum of min(1, C / ||x||) * x, the examples, the clipped ones."""
    sums = [np.zeros(layer.shape, np.float64) for layer in LAYERS]
    examples = clipped = 0
    for arrays in batches:
        flat = np.concatenate([a.astype(np.float64).reshape(ROWS, -1) for a in arrays], axis=1)
        norms = np.sqrt(np.sum(flat * flat, axis=1))
        factors = np.where(norms > CLIP, CLIP / np.where(norms > 0, norms, 1.0), 1.0)
        for k, a in enumerate(arrays):
            sums[k] += np.tensordot(factors, a.astype(np.float64), axes=1)
        examples += ROWS
        clipped += int(np.sum(norms > CLIP))
    return sums, examples, clipped


def assert_matches_reference(totals: PartialState, batches: list[list[np.ndarray]]) -> None:
    sums, examples, clipped = reference(batches)
    for got, want in zip(totals.sums, sums):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert totals.examples == examples
    assert totals.batches == len(batches)
    assert int(totals.clip_counts[0]) == clipped and 0 < clipped < examples


def uninterrupted(aggregation_id: str, shard: int, sends: list[tuple[str, int, int]],
                  writers: dict[str, str] | None = None) -> PartialState:
    """The totals of the same batches sent once each to an in-process owner on a memory store."""
    store = MemoryStore()
    store.create(AggregationRecord(aggregation_id, SPEC))
    owner = ShardOwner(store, aggregation_id, shard, SPEC)
    for client, sequence, seed in sends:
        owner.submit(client, (writers or {}).get(client, f"{client}-writer"), sequence, batch(seed))
    return owner.totals


def slow_updates(clients: dict, started):
    """``updates(name)`` for ``submitting``: a client's batches, 0.05 s apart; ``started`` released after the second."""
    def updates(name: str):
        for j, arrays in enumerate(clients[name]):
            yield {layer.name: a for layer, a in zip(LAYERS, arrays)}
            if j == 1:
                started.release()
            time.sleep(0.05)
    return updates


def assert_result_exact(result, clients: dict) -> None:
    """A finalized result holds exactly every batch of ``clients`` (4 clients x 6 batches), clipped."""
    sums, examples, clipped = reference([arrays for batches in clients.values() for arrays in batches])
    assert result.examples == examples == 4 * 6 * ROWS
    assert result.clip_counts == {"w": clipped, "b": clipped}
    for layer, want in zip(LAYERS, sums):
        np.testing.assert_allclose(result.sums[layer.name], want, rtol=1e-5, atol=1e-5)


def new_aggregation(dsn: str, aggregation_id: str) -> PostgresStore:
    store = PostgresStore(dsn)
    store.create(AggregationRecord(aggregation_id, SPEC, created=time.time()))
    return store


def get(ref):
    return ray.get(ref, timeout=GET_TIMEOUT)


# 1. ShardOwner without Ray --------------------------------------------------------------------
def test_owner_exactly_once_restore_and_fencing_without_ray(pg):
    dsn = pg.new_database()
    store = new_aggregation(dsn, "agg")
    with pytest.raises(ValueError, match="2 shard"):
        ShardOwner(store, "agg", 2, SPEC)
    owner = ShardOwner(store, "agg", 1, SPEC)
    assert owner.epoch == 1 and owner.totals == PartialState.empty(LAYERS)

    assert owner.submit("alice", "a1", 1, batch(1)) == 1
    after_one = owner.totals
    assert owner.submit("alice", "a1", 1, batch(99)) == 1  # a duplicate: nothing summed
    assert owner.totals == after_one
    with pytest.raises(ValueError, match="gap"):
        owner.submit("alice", "a1", 3, batch(3))
    with pytest.raises(ValueError, match="shape"):
        owner.submit("alice", "a1", 2, [batch(2)[0][:, :2], batch(2)[1]])
    assert owner.submit("alice", "a1", 2, batch(2)) == 2
    assert owner.submit("bob", "b1", 1, batch(10)) == 1
    assert owner.submit("bob", "b1", 2, batch(11)) == 2
    assert owner.submit("bob", "b1", 1, batch(10)) == 2  # a duplicate returns the durable mark

    assert_matches_reference(owner.totals, [batch(1), batch(2), batch(10), batch(11)])
    assert dict(owner.totals.clients) == {"alice": (2, "a1"), "bob": (2, "b1")}
    assert store.load_checkpoint("agg", shard=1) == owner.totals
    assert store.load_checkpoint("agg", shard=0) is None
    assert PartialState.from_bytes(owner.totals_bytes()) == owner.totals

    # A new owner (another process, another connection) restores and goes on where the old one stopped.
    restored = ShardOwner(PostgresStore(dsn), "agg", 1, SPEC)
    assert restored.epoch == 2 and restored.totals == owner.totals
    assert restored.mark("alice") == 2 and restored.mark("carol") == 0
    assert restored.submit("alice", "a1", 2, batch(2)) == 2  # duplicate after restore
    with pytest.raises(ValueError, match="gap"):
        restored.submit("alice", "a1", 4, batch(4))
    assert restored.submit("alice", "a1", 3, batch(3)) == 3

    # The old owner is fenced out: its commit is refused, and so is every later call.
    committed = owner.totals
    with pytest.raises(FencedOut):
        owner.submit("alice", "a1", 3, batch(33))
    with pytest.raises(FencedOut):
        owner.submit("bob", "b1", 1, batch(10))
    assert owner.totals == committed
    final = store.load_checkpoint("agg", shard=1)
    assert final == restored.totals
    assert_matches_reference(final, [batch(1), batch(2), batch(3), batch(10), batch(11)])
    assert final == uninterrupted("agg", 1, [("alice", 1, 1), ("alice", 2, 2), ("bob", 1, 10), ("bob", 2, 11),
                                             ("alice", 3, 3)], {"alice": "a1", "bob": "b1"})


def test_submit_many_commits_a_group_at_once_and_a_gap_commits_nothing(pg):
    store = new_aggregation(pg.new_database(), "grouped")
    owner = ShardOwner(store, "grouped", 0, SPEC)
    assert owner.submit_many([("alice", "w", 1, batch(1)), ("bob", "w", 1, batch(2)),
                              ("alice", "w", 2, batch(3)), ("alice", "w", 1, batch(1))]) == [1, 1, 2, 2]
    assert store.load_checkpoint("grouped", shard=0) == owner.totals  # one commit holds the group
    before = owner.totals
    with pytest.raises(ValueError, match="gap"):  # bob 2 is fine, bob 4 is not: neither is committed
        owner.submit_many([("bob", "w", 2, batch(4)), ("bob", "w", 4, batch(5))])
    assert owner.totals == before and store.load_checkpoint("grouped", shard=0) == before
    assert_matches_reference(owner.totals, [batch(1), batch(2), batch(3)])


# 2. A shard actor killed mid-stream -------------------------------------------------------------
def test_killed_actor_is_restarted_restores_and_counts_every_batch_once(pg, ray_cluster):
    dsn = pg.new_database()
    store = new_aggregation(dsn, "agg")
    actor = shard_actor(dsn, "agg", 1, SPEC)
    sends = [("alice", s, s) for s in range(1, 9)] + [("bob", s, 100 + s) for s in range(1, 5)]
    sends.sort(key=lambda send: (send[1], send[0]))  # interleaved: alice 1, bob 1, alice 2, ...
    try:
        pids = [get(actor.pid.remote())]
        assert get(actor.get_epoch.remote()) == 1
        for i, (client, sequence, seed) in enumerate(sends):
            if i == 4:
                # Committed and acknowledged, then the process dies: the resend is a duplicate.
                assert get(actor.submit.remote(client, f"{client}-writer", sequence, batch(seed))) == sequence
                os.kill(pids[-1], signal.SIGKILL)
            elif i == 8:
                # In flight when the process dies: committed or not, the resend makes it count once.
                actor.submit.remote(client, f"{client}-writer", sequence, batch(seed))
                os.kill(pids[-1], signal.SIGKILL)
            acked = call_until_answered(lambda: actor.submit.remote(client, f"{client}-writer", sequence, batch(seed)),
                                        timeout=90)
            assert acked == sequence
            if i in (4, 8):
                pids.append(get(actor.pid.remote()))
                assert pids[-1] != pids[-2]
        assert get(actor.get_epoch.remote()) == 3  # two restarts, each claimed the shard anew

        totals = PartialState.from_bytes(get(actor.totals_bytes.remote()))
        assert totals == store.load_checkpoint("agg", shard=1)
        assert dict(totals.clients) == {"alice": (8, "alice-writer"), "bob": (4, "bob-writer")}
        assert_matches_reference(totals, [batch(seed) for _, _, seed in sends])
        assert totals == uninterrupted("agg", 1, sends)
    finally:
        ray.kill(actor, no_restart=True)


# 3. A stale owner is fenced out --------------------------------------------------------------------
def test_stopped_owner_is_fenced_out_by_its_replacement(pg, ray_cluster):
    dsn = pg.new_database()
    store = new_aggregation(dsn, "agg")
    a = shard_actor(dsn, "agg", 0, SPEC)
    b = None
    pid_a = get(a.pid.remote())
    try:
        assert get(a.submit.remote("alice", "w", 1, batch(1))) == 1
        os.kill(pid_a, signal.SIGSTOP)  # A is believed dead, but its process lives on
        stale = a.submit.remote("alice", "w", 2, batch(2))  # waits in A's queue while A is stopped

        b = shard_actor(dsn, "agg", 0, SPEC)  # the replacement claims the shard: epoch 2
        assert get(b.get_epoch.remote()) == 2
        assert get(b.submit.remote("alice", "w", 1, batch(1))) == 1  # restored: a duplicate
        assert get(b.submit.remote("alice", "w", 2, batch(20))) == 2
        assert get(b.submit.remote("alice", "w", 3, batch(30))) == 3

        os.kill(pid_a, signal.SIGCONT)  # A wakes up, sums its batch 2 and tries to commit it
        with pytest.raises(FencedOut):
            get(stale)
        with pytest.raises(FencedOut):  # and refuses everything from then on, duplicates included
            get(a.submit.remote("alice", "w", 1, batch(1)))
        assert get(a.pid.remote()) == pid_a  # a fenced actor does not exit (a restart would claim back)

        totals_b = PartialState.from_bytes(get(b.totals_bytes.remote()))
        in_store = store.load_checkpoint("agg", shard=0, newest_only=True)
        assert in_store == totals_b
        assert dict(in_store.clients) == {"alice": (3, "w")}
        assert_matches_reference(in_store, [batch(1), batch(20), batch(30)])
        assert in_store == uninterrupted("agg", 0, [("alice", 1, 1), ("alice", 2, 20), ("alice", 3, 30)],
                                         {"alice": "w"})
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid_a, signal.SIGCONT)
        ray.kill(a, no_restart=True)
        if b is not None:
            ray.kill(b, no_restart=True)


# 4. The whole server on the cluster: clipd serve --ray ------------------------------------------
def test_a_server_on_ray_sums_through_ingest_and_shard_actors_while_actors_are_killed(pg, ray_cluster):
    """``Settings(ray_address=...)``: 4 clients through 2 ingest actors (one port, any node) into 2 shard actors.

    While the streams run, one ingest actor and one shard actor are SIGKILLed: Ray restarts both,
    the clients reconnect (to either ingest actor) and resume, the shard restores from the store.
    """
    import threading

    from clipd.client import Client
    from clipd.server.app import create_server
    from clipd.server.settings import Settings
    from conftest import TEST_SETTINGS

    from service_helpers import free_port, submitting

    settings = Settings(**{**TEST_SETTINGS, "data_dir": pg.new_database(), "ray_address": ray_cluster.address,
                           "shards": 2, "ray_ingest_actors": 2, "ray_ingest_port": free_port()})
    server, _ = create_server(settings)
    target = f"127.0.0.1:{settings.ray_ingest_port}"  # the ingest actors', not the server's port
    clients = {f"client-{i}": [batch(1000 * i + j) for j in range(6)] for i in range(4)}
    started = threading.Semaphore(0)
    try:
        with Client(target) as c:
            aggregation = c.create_aggregation({layer.name: layer.shape for layer in LAYERS}, l2_norm_clip=CLIP,
                                               aggregation_id="on-ray")

        updates = slow_updates(clients, started)

        with submitting(target, aggregation, clients, updates, 6 * ROWS, retry_delay=0.05, message_bytes=1 << 10):
            for _ in clients:
                assert started.acquire(timeout=60)
            (actor_entry,) = [d for d in server.devices.describe() if d["id"] == "on-ray/0"]
            assert actor_entry["kind"] == "ray-shard-actor"
            ingest = server.ingest.describe()
            assert [p["alive"] for p in ingest] == [True, True]
            assert {p["address"].rsplit(":", 1)[1] for p in ingest} == {str(settings.ray_ingest_port)}
            os.kill(ingest[0]["pid"], signal.SIGKILL)  # its streams break; Ray restarts it on the same port
            link = server.devices._links[server.registry.get("on-ray")][0]
            os.kill(get(link.actor.pid.remote()), signal.SIGKILL)  # Ray restarts it; it restores shard 0
        assert get(link.actor.get_epoch.remote()) == 2
        with Client(target) as c:
            result = c.finalize(aggregation)
        restarted = server.ingest.describe()[0]
        assert restarted["alive"] and restarted["pid"] != ingest[0]["pid"]
        assert sum(server.guard.forwarded.values()) > 0 and not server.guard.forwarded.keys() - {"0", "1"}
    finally:
        server.stop(1.0)
    assert_result_exact(result, clients)


def test_shard_hosts_on_ray_under_mutual_tls_sum_with_no_byte_through_the_server(pg, ray_cluster, tmp_path):
    """``--ray-shard-hosts 2`` under mutual TLS: clients stream straight to the host that sums their shard; one
    host SIGKILLed.

    Every endpoint speaks TLS and asks for a client certificate: the hosts' ports (plaintext and a rogue CA's
    client refused there), and the server's port, which the hosts reach with the server's certificate as
    theirs (``peer_channel``). Ray restarts the killed host, which opens the aggregation from the store again
    (its shard's checkpoint), the clients ask for the placement again and resume; the result is exact and
    the server received no payload.
    """
    import threading

    import grpc

    from clipd.client import Client
    from clipd.server.app import create_server
    from clipd.server.settings import Settings
    from clipd.v1 import clipd_pb2 as pb
    from clipd.v1 import clipd_pb2_grpc as pb_grpc
    from conftest import TEST_SETTINGS
    from test_tls import _issue

    from service_helpers import free_port, submitting

    ca, ca_pair = _issue(tmp_path, "ca", "clipd test CA", ca=True)
    server_pem, _ = _issue(tmp_path, "server", "localhost", ca_pair, server=True, client_too=True)
    client_pem, _ = _issue(tmp_path, "client", "clipd client", ca_pair)
    _, rogue_pair = _issue(tmp_path, "rogue-ca", "rogue CA", ca=True)
    rogue_pem, _ = _issue(tmp_path, "rogue-client", "clipd client", rogue_pair)
    tls = {"tls_cert_file": str(server_pem.cert), "tls_key_file": str(server_pem.key),
           "tls_client_ca_file": str(ca.cert)}
    credentials = dict(root_certificates=ca.cert_bytes, client_certificate=client_pem.cert_bytes,
                       client_key=client_pem.key_bytes)
    settings = Settings(**{**TEST_SETTINGS, **tls, "data_dir": pg.new_database(), "ray_address": ray_cluster.address,
                           "ray_shard_hosts": 2, "ray_ingest_port": free_port()})
    server, _ = create_server(settings)
    target = f"127.0.0.1:{settings.ray_ingest_port}"  # the hosts' shared port, on any node
    clients = {f"client-{i}": [batch(2000 * i + j) for j in range(6)] for i in range(4)}
    started = threading.Semaphore(0)
    try:
        with Client(target, **credentials) as c:
            aggregation = c.create_aggregation({layer.name: layer.shape for layer in LAYERS}, l2_norm_clip=CLIP,
                                               aggregation_id="on-hosts")
            placement = c.placement(aggregation)
        assert placement.shards == 2 and len(set(placement.endpoints)) == 2
        for endpoint in placement.endpoints:  # each host's own port: TLS, and only this CA's client certificates
            for channel in (grpc.insecure_channel(endpoint), grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(
                    ca.cert_bytes, rogue_pem.key_bytes, rogue_pem.cert_bytes))):
                with channel, pytest.raises(grpc.RpcError) as e:
                    pb_grpc.ClipdStub(channel).GetPlacement(pb.GetPlacementRequest(aggregation_id=aggregation),
                                                           timeout=10)
                assert e.value.code() is grpc.StatusCode.UNAVAILABLE

        updates = slow_updates(clients, started)

        with submitting(target, aggregation, clients, updates, 6 * ROWS, retry_delay=0.05, retry_timeout=120,
                        message_bytes=1 << 10, **credentials):
            for _ in clients:
                assert started.acquire(timeout=60)
            victim = server.devices.describe_processes()[0]
            os.kill(victim["pid"], signal.SIGKILL)  # Ray restarts it; it opens the aggregation from the store
        with Client(target, **credentials) as c:
            result = c.finalize(aggregation)
        assert server.servicer.payload_bytes == 0  # no payload byte reached the server
        assert sum(server.guard.forwarded.values()) > 0  # the hosts reached the server's mutual-TLS port
        deadline = time.monotonic() + 30
        while server.devices.describe_processes()[0]["restarts"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        server.stop(1.0)
    assert_result_exact(result, clients)


def test_ray_shards_keep_the_shards_contract(pg, ray_cluster):
    """Ray shard actors (``--ray``) keep the contract of every kind of shards (tests/shards_contract.py), as the
    local devices and shard processes do. (Ray shard hosts are shard processes; the mutual-TLS test of this file runs them.)"""
    from clipd.server.app import create_server
    from clipd.server.settings import Settings
    from conftest import TEST_SETTINGS
    from shards_contract import check_shards_contract

    settings = Settings(**{**TEST_SETTINGS, "data_dir": pg.new_database(), "ray_address": ray_cluster.address,
                           "shards": 2})
    server, port = create_server(settings)
    try:
        check_shards_contract(server, f"127.0.0.1:{port}")
    finally:
        server.stop(1.0)
