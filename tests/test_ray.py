"""Shard hosts on a local two-node Ray cluster, checkpointing to a throwaway PostgreSQL (clipd/server/shards/ray_hosts.py).

- ``--ray`` alone: one shard host on each node, keeping the contract of every kind of shards.
- ``--ray-shard-hosts 2`` under mutual TLS: clients stream straight to the hosts, one host is SIGKILLed
  mid-stream and restarted by Ray, the result is exact and no payload byte reaches the server.

The reference is a float64 numpy global-L2 clip written here (not clipd's code): the sums match
it to float32 accuracy, the counts exactly.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import ray  # noqa: E402  (the [test] extra installs it: a missing Ray fails, it is not skipped)
import ray.cluster_utils  # noqa: E402
from helpers import wait_until  # noqa: E402
from test_postgres_store import pg_cluster  # noqa: E402,F401  (a fixture)

from clipd.engine import LayerSpec  # noqa: E402

CLIP = 1.0
LAYERS = (LayerSpec("w", (4, 3), "float32"), LayerSpec("b", (5,), "float32"))
ROWS = 8

# Ray starts its node processes with subprocess (fork + exec) after JAX is imported here: harmless.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")


# Fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pg(pg_cluster):  # noqa: F811 (the imported fixture, by name)
    """The throwaway PostgreSQL of tests/test_postgres_store.py."""
    return pg_cluster


@pytest.fixture(scope="module")
def ray_cluster():
    """Two Ray nodes with one CPU each (a shard host asks for a quarter of a CPU)."""
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
    from conftest import TEST_SETTINGS
    from service_helpers import free_port, submitting
    from test_tls import _issue

    from clipd.client import Client
    from clipd.server.app import create_server
    from clipd.server.settings import Settings
    from clipd.v1 import clipd_pb2 as pb
    from clipd.v1 import clipd_pb2_grpc as pb_grpc

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
        wait_until(lambda: server.devices.describe_processes()[0]["restarts"] >= 1, 30, "the killed host restarted",
                   step=0.2)
        # The server counts its hosts' slots and what they received (their loads come with their statistics).
        wait_until(lambda: server.snapshot().load.stream_limit == 2 * settings.max_streams, 15,
                   lambda: f"both hosts' slots counted: {server.snapshot()}", step=0.1)
        assert server.snapshot().shard_payload_bytes == sum(p["payload_bytes"] for p in server.snapshot().shard_processes) > 0
    finally:
        server.stop(1.0)
    assert_result_exact(result, clients)


def test_ray_shard_hosts_one_on_each_node_keep_the_shards_contract(pg, ray_cluster):
    """``--ray`` alone: a shard host on each of the cluster's two nodes, keeping the contract of every kind of
    shards (tests/shards_contract.py), as the local devices and shard processes do."""
    from conftest import TEST_SETTINGS
    from service_helpers import free_port
    from shards_contract import check_shards_contract

    from clipd.server.app import create_server
    from clipd.server.settings import Settings

    settings = Settings(**{**TEST_SETTINGS, "data_dir": pg.new_database(), "ray_address": ray_cluster.address,
                           "ray_ingest_port": free_port()})
    server, _ = create_server(settings)
    try:
        hosts = server.devices.describe_processes()
        assert len(hosts) == 2 and len({h["endpoint"].rsplit(":", 1)[1] for h in hosts}) == 2  # one per node
        check_shards_contract(server, f"127.0.0.1:{settings.ray_ingest_port}")
        assert server.servicer.payload_bytes == 0  # the hosts received every payload byte
    finally:
        server.stop(1.0)
