"""One whole batch clipped and summed on the calling thread: a DP-SGD step's (``rpc.steps``).

A step's aggregation takes one batch and is released at once: nothing queues behind it, nothing is checkpointed,
nothing stays on the device. Through the device worker it would cross five threads (the warm-up's open, the
queued batch, the final flush, the committer, the forget), each a wake-up that costs more than a small model's
step. Here the caller runs the worker's own steps in line, on the device of the batch's shard: the same packing
(:func:`~clipd.server.summing.packing.pack`), the same programs (:meth:`ShardSlot.run`, compiled on first use,
cached as the worker's are), the same delta added into the same float64 totals (:meth:`ShardSlot.absorb_into`).
So a step's sums are bit for bit the sums of the same batch submitted to an aggregation of the same spec
(tests/test_steps.py compares them).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import jax
import numpy as np

from clipd.server.aggregations import Aggregation
from clipd.server.summing.batch import Batch
from clipd.server.summing.memory import aligned_empty
from clipd.server.summing.packing import Step, pack
from clipd.server.summing.programs import bucket_for, bucket_sizes, sums_on_host
from clipd.server.summing.slots import ShardSlot

KEPT_STAGING_BYTES = 64 << 20  # staging buffers kept for the next steps (a trainer's steps are alike)


class _Queued(NamedTuple):
    """What :func:`pack` reads of a queued batch."""

    client: str
    writer: str
    batch: Batch


class StagingPool:
    """Staging buffers kept between steps, by shapes and rows: a step's fresh pages (a megabyte or more, faulted in
    on first touch) cost more than the step itself. Keeps at most ``limit`` bytes; thread-safe.

    >>> pool = StagingPool(limit=1 << 20)
    >>> shapes = (((3,), np.dtype(np.float32)),)
    >>> first = pool.take(shapes, 4)
    >>> pool.give(shapes, 4, first)
    >>> pool.take(shapes, 4) is first
    True
    """

    def __init__(self, limit: int = KEPT_STAGING_BYTES) -> None:
        self.limit = limit
        self._free: dict[tuple, list[list[np.ndarray]]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, shapes: tuple, rows: int) -> list[np.ndarray]:
        with self._lock:
            free = self._free.get((shapes, rows))
            if free:
                buffers = free.pop()
                self._bytes -= sum(b.nbytes for b in buffers)
                return buffers
        return [aligned_empty((rows, *shape), dtype) for shape, dtype in shapes]

    def give(self, shapes: tuple, rows: int, buffers: list[np.ndarray]) -> None:
        nbytes = sum(b.nbytes for b in buffers)
        with self._lock:
            if self._bytes + nbytes <= self.limit:
                self._free.setdefault((shapes, rows), []).append(buffers)
                self._bytes += nbytes


STAGING = StagingPool()


def sum_batch(aggregation: Aggregation, shard: int, client: str, writer: str, batch: Batch, device) -> None:
    """Clips and sums ``batch`` (accepted: ``Aggregation.accept``) into ``shard``'s totals now, on ``device``; its
    buffers are given back. The aggregation counts it summed (``Aggregation.record``) as the worker would.

    A batch of at most ``device_rows`` rows is one step of its bucket's size (staged in a buffer of that many rows,
    or read in place when its own rows fill the bucket in aligned memory); a larger one, steps of ``device_rows``.
    """
    shapes = tuple((layer.shape, np.dtype(layer.dtype)) for layer in aggregation.layers)
    rows = aggregation.device_rows
    if batch.rows <= rows:
        rows = bucket_for(batch.rows, bucket_sizes(rows))
    staging: list[np.ndarray] = []

    def staging_buffers() -> list[np.ndarray]:  # one set, reused: each step is done before the next is filled
        if not staging:
            staging.extend(STAGING.take(shapes, rows))
        return staging

    try:
        with jax.default_device(device):
            slot = ShardSlot(aggregation.accumulator.init(sums=not sums_on_host(aggregation, device)))
            for item in pack(_Queued(client, writer, batch), rows, staging_buffers, lambda rows, wait: None,
                             deadline=0.0):
                if not isinstance(item, Step):
                    continue  # (the batch's buffers go at the end: a step may read them in place)
                example, scales = slot.run(aggregation, item)
                if example is not None:  # sums on the host: the example measured, added here
                    aggregation.add_example(shard, example, jax.device_get(scales))
                else:
                    jax.block_until_ready(slot.delta)  # (its staging buffer is filled again next)
                slot.count(item.done)
                aggregation.record(item.done, None, shard)  # (its statistics: in the totals, next)
                if slot.flush_due(aggregation):
                    slot.absorb_into(aggregation, shard)
            if slot.steps:
                slot.absorb_into(aggregation, shard, restart=False)
    finally:
        batch.give_back()
        if staging:
            STAGING.give(shapes, rows, staging)
