"""The contract every kind of shards keeps (:class:`clipd.server.lifecycle.Shards`), run through a real server.

tests/test_shards_contract.py runs it against the local devices and shard processes, tests/test_ray.py
against Ray shard hosts (beside its Ray cluster). The reference is the float64 numpy clip of
tests/service_helpers.py, not clipd's code.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from helpers import wait_until
from service_helpers import assert_exact_global_clip, random_batch

from clipd.client import Client, NotFoundError, Privacy
from clipd.server.lifecycle import Shards

LAYERS = {"w": (12, 5), "b": (5,)}
CLIP = 1.0
ROWS = 8
BATCHES = 3
CLIENTS = [f"client-{i}" for i in range(4)]


def check_shards_contract(server, target: str, **client_options) -> None:
    """One server's shards, whatever their kind: declared interface, exact sums, appends, cancel, finalize, and
    fixed-point sums under secure noise."""
    kind = server.devices
    assert isinstance(kind, Shards), f"{type(kind).__name__} does not have every method of Shards"
    assert len(kind) >= 1 and isinstance(kind.device_kind, str) and kind.device_kind
    # Every shard host up (a device ran its first program, a process serves).
    wait_until(lambda: kind.ready, 60, "the shards ready", step=0.05)
    with Client(target, **client_options) as c:
        # Every client's batches land in its shard and are counted once, appends included.
        aggregation = c.create_aggregation(LAYERS, l2_norm_clip=CLIP)
        for client in CLIENTS:
            first = c.submit(aggregation, [random_batch(client, i, LAYERS, ROWS) for i in range(BATCHES - 1)],
                             client_id=client)
            assert first.examples == (BATCHES - 1) * ROWS
            again = c.submit(aggregation, random_batch(client, BATCHES - 1, LAYERS, ROWS), client_id=client)
            assert again.examples == ROWS  # appended after the client's acknowledged batches
        assert kind.queue_depth >= 0 and kind.queued_bytes >= 0
        devices = kind.describe()
        assert devices and all({"id", "kind", "platform", "steps"} <= d.keys() for d in devices)
        result = c.finalize(aggregation)
        assert_exact_global_clip(result, CLIENTS, range(BATCHES), ROWS, LAYERS, CLIP)
        repeated = c.finalize(aggregation)  # idempotent: the same result, nothing summed again
        assert repeated.examples == result.examples
        for name in LAYERS:
            np.testing.assert_array_equal(repeated.sums[name], result.sums[name])

        # A cancelled aggregation leaves nothing behind: the same id starts from zero.
        doomed = c.create_aggregation(LAYERS, l2_norm_clip=CLIP, aggregation_id="contract-doomed")
        c.submit(doomed, random_batch("x", 0, LAYERS, ROWS), client_id="x")
        c.cancel(doomed)
        with pytest.raises(NotFoundError):
            c.finalize(doomed)
        fresh = c.create_aggregation(LAYERS, l2_norm_clip=CLIP, aggregation_id="contract-doomed")
        c.submit(fresh, random_batch("y", 0, LAYERS, ROWS), client_id="y")
        assert_exact_global_clip(c.finalize(fresh), ["y"], range(1), ROWS, LAYERS, CLIP)

        # Under secure noise every kind sums in fixed point on the release's grid: with z = 0 the release is exactly
        # the sum of each example's grid integers, whichever shard summed it (rows far under the bound: unclipped).
        secure = Privacy(f"contract-{uuid.uuid4().hex[:10]}", 1e-5, noise_multiplier=0.0, noise="secure",
                         accountant="zcdp")
        exact = c.create_aggregation(LAYERS, l2_norm_clip=CLIP, privacy=secure)
        sent = {client: {name: x * 0.01 for name, x in random_batch(client, 0, LAYERS, ROWS).items()}
                for client in CLIENTS}
        for client, rows in sent.items():
            c.submit(exact, rows, client_id=client)
        released = c.finalize(exact)
        step = released.release.grid_step
        assert step > 0
        for name in LAYERS:
            expected = sum(np.rint(rows[name].astype(np.float64) / step).sum(axis=0) for rows in sent.values())
            np.testing.assert_array_equal(released.sums[name], expected * step)
