"""Every local device at work: 4 forced host devices, one shard each, through a SIGKILL.

``clipd serve`` runs as a real process with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``: an aggregation has 4
shards, one per device. Eight clients (two per shard) stream half their
batches, the server is killed with SIGKILL and restarted on the same data
directory, and the clients append the other half. Each shard must come back
from its own checkpoint (what was acknowledged is in, nothing twice), every
device must step, and the result must equal a float64 numpy reference
(``service_helpers.global_clip_reference``, not clipd's code). The shard of a
client is recomputed here from its definition (CRC-32 of the id modulo the
shard count), not taken from clipd.
"""

from __future__ import annotations

import zlib

from service_helpers import ServerProcess, assert_exact_global_clip, free_port, get_json, random_batch, submitting

from clipd.client import Client
from clipd.server.stores.sqlite import SQLiteStore

DEVICES = 4
LAYERS = {"w": (32, 8), "b": (8,)}
CLIP = 1.0
ROWS = 16  # examples per batch
BATCHES = 6  # per client: 3 before the kill, 3 after


def _clients() -> list[str]:
    """Eight client ids, two for each of the four shards."""
    chosen: dict[int, list[str]] = {k: [] for k in range(DEVICES)}
    for i in range(1000):
        shard = zlib.crc32(f"client-{i}".encode()) % DEVICES
        if len(chosen[shard]) < 2:
            chosen[shard].append(f"client-{i}")
    return [c for k in range(DEVICES) for c in chosen[k]]


def _submit_all(target: str, aggregation: str, clients: list[str], indices: range) -> None:
    with submitting(target, aggregation, clients, lambda c: [random_batch(c, i, LAYERS, ROWS) for i in indices],
                    ROWS * len(indices), retry_delay=0.05):
        pass


def test_four_devices_each_sum_a_shard_and_each_shard_recovers_on_its_own(tmp_path):
    admin_port = free_port()
    server = ServerProcess(tmp_path / "data", tmp_path / "jax-cache", free_port(),
                           args=("--admin-port", str(admin_port), "--max-device-rows", "64"),
                           env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}"})
    clients = _clients()
    server.start()
    target = f"127.0.0.1:{server.port}"
    try:
        with Client(target) as admin:
            aggregation = admin.create_aggregation(LAYERS, l2_norm_clip=CLIP, aggregation_id="devices")
        _submit_all(target, aggregation, clients, range(0, 3))
        server.kill()  # acknowledged means durable: each shard's checkpoint must hold its clients' batches
        server.start()
        _submit_all(target, aggregation, clients, range(3, BATCHES))

        devices = get_json(f"http://127.0.0.1:{admin_port}/api/v1/server")["devices"]
        assert sorted(d["id"] for d in devices) == list(range(DEVICES))
        assert all(d["steps"] > 0 and d["platform"] == "cpu" for d in devices), devices  # since the restart

        with Client(target) as admin:
            result = admin.finalize(aggregation)
        assert_exact_global_clip(result, clients, range(BATCHES), ROWS, LAYERS, CLIP)
    finally:
        server.stop()

    store = SQLiteStore(str(tmp_path / "data"))  # each shard's final checkpoint holds its own clients only
    try:
        for shard in range(DEVICES):
            state = store.load_checkpoint("devices", shard=shard, newest_only=True)
            mine = {c for c in clients if zlib.crc32(c.encode()) % DEVICES == shard}
            assert set(state.clients) == mine and len(mine) == 2
            assert state.examples == 2 * BATCHES * ROWS
    finally:
        store.close()
