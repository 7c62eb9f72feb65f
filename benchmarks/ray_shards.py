"""Ray shard actors against local devices: acknowledged batches per second through the whole server.

Three servers, one after the other, on the same machine and the same PostgreSQL store:

  devices    ``clipd serve --data-dir postgresql://...``: shards on the local JAX device;
  ray 1x1    ``--ray ADDRESS``: the shard is a Ray actor; the server's link sends one batch per
             call and waits for it (each batch its own checkpoint commit in the actor);
  ray 4x64   the same with the link's defaults: every batch waiting goes in one call (up to 64,
             one checkpoint commit: group commit), up to 4 calls in flight.

Each: one aggregation of 16,384 float32 parameters (64 KiB an example), one shard; a client
submits 64 batches of one example (``message_bytes`` 64 KiB: a batch a message), ``--repeats``
times (median). The clock runs until every batch is acknowledged (durable). Ray runs as a
local one-node cluster (``ray.cluster_utils.Cluster``) started here; PostgreSQL is ``--dsn``, or
a throwaway cluster started here as the ``postgres`` user (Debian's postgresql-15, as the tests do).
The last line is ``ray_vs_devices_ratio=<x>`` (ray 4x64 over devices, batches per second).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", default=None, help="a PostgreSQL database URL (default: a throwaway cluster)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, default=64)
    args = parser.parse_args()

    import ray
    import ray.cluster_utils

    from clipd.client import Client
    from clipd.server.shards import ray_actors as ray_shards
    from clipd.server.app import create_server
    from clipd.server.settings import Settings

    pg = None
    if args.dsn is None:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from test_postgres_store import Cluster  # the tests' throwaway PostgreSQL

        pg = Cluster()
        pg.start()
    cluster = ray.cluster_utils.Cluster(initialize_head=True,
                                        head_node_args=dict(num_cpus=2, include_dashboard=False))
    ray.init(address=cluster.address, log_to_driver=False)
    x = np.random.default_rng(0).standard_normal((args.batches, 256, 64)).astype(np.float32)
    rates = {}
    try:
        for mode, link in (("devices", None), ("ray 1x1", (1, 1)), ("ray 4x64", (4, 64))):
            settings = dict(grpc_port=0, admin_port=-1, max_device_rows=64,
                            data_dir=args.dsn if pg is None else pg.new_database())
            if link is not None:
                settings.update(ray_address=cluster.address, shards=1)
                ray_shards.RayShards.link_window, ray_shards.RayShards.link_group = link
            server, port = create_server(Settings(**settings))
            try:
                with Client(f"127.0.0.1:{port}", message_bytes=64 << 10) as c:
                    aggregation = c.create_aggregation({"w": (256, 64)}, l2_norm_clip=1.0)
                    c.submit(aggregation, {"w": x[:2]}, client_id="warm-up")  # compiles
                    times = []
                    for repeat in range(args.repeats):
                        start = time.perf_counter()
                        c.submit(aggregation, {"w": x}, client_id=f"client-{repeat}")
                        times.append(time.perf_counter() - start)
                    assert c.finalize(aggregation).examples == args.batches * args.repeats + 2
            finally:
                server.stop(1.0)
            rates[mode] = args.batches / statistics.median(times)
            print(f"  {mode}: {rates[mode]:.0f} batches/s", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
        if pg is not None:
            pg.stop()
    print()
    print(f"{'server':<10}| {'batches/s':>9} | {'vs devices':>10}")
    print("-" * 36)
    for mode, rate in rates.items():
        print(f"{mode:<10}| {rate:9.0f} | {rate / rates['devices']:10.3f}")
    print()
    print(f"ray_vs_devices_ratio={rates['ray 4x64'] / rates['devices']:.3f}")


if __name__ == "__main__":
    main()
