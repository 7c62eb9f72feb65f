"""Packing a shard's queued batches into device steps: which rows go into which step, copied or read in place.

A step holds ``capacity`` rows (the aggregation's ``device_rows``). Consecutive batches of one shard are copied
into a 64-byte-aligned staging buffer until it is full or nothing more comes soon; a batch whose own rows fill a
whole step in aligned buffers (a large update, received straight into aligned memory) goes to the step as it is,
with no copy. :func:`pack` says what to do and in which order; the device worker does it (dispatches each
:class:`Step`, gives back or holds each :class:`Packed` batch). It touches no device and no queue of its own.

>>> import types
>>> import numpy as np
>>> def queued(sequence, rows):
...     return types.SimpleNamespace(client="c", writer="w", batch=Batch(sequence, rows, [np.ones((rows, 2))], 0))
>>> later = iter([queued(2, 3)])
>>> staging = [np.zeros((4, 2))]
>>> for item in pack(queued(1, 3), 4, lambda: staging, lambda rows, wait: next(later, None), deadline=0.0):
...     print(item.rows, [d[2] for d in item.done]) if isinstance(item, Step) else print("packed", item.batch.sequence)
packed 1
4 [1]
packed 2
2 [2]

Batch 1's 3 rows and the first of batch 2's fill a step of 4, which completes batch 1; batch 2's other 2 rows go
in a step of their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from clipd.server.summing.batch import Batch
from clipd.server.summing.memory import ALIGNMENT

# (client, writer, sequence, rows, nbytes) of a batch whose last rows are in a step: summed when the step is
Done = tuple[str, str, int, int, int]


@dataclasses.dataclass
class Step:
    """One device step: ``rows`` valid rows of ``layers`` (a staging buffer, or a batch's own aligned rows when
    not ``staged``), the batches it completes, and each row's weight (its batch's)."""

    layers: list[np.ndarray]
    rows: int
    done: list[Done]
    staged: bool = True
    weights: np.ndarray | None = None  # float32 (rows,): each row's batch's weight


@dataclasses.dataclass
class Packed:
    """Every row of ``batch`` is in a step (dispatched, or copied into the staging buffer): its buffers may go,
    unless ``in_place`` (a step read some of its rows as they are: its buffers go once that step is done)."""

    batch: Batch
    in_place: bool


def aligned_rows(batch: Batch, start: int, rows: int) -> list[np.ndarray] | None:
    """``batch``'s rows ``[start, start + rows)`` of every layer, if they are there and each starts on an
    ``ALIGNMENT``-byte boundary: JAX on the CPU then reads them in place, and the step needs no copy
    into the staging buffer (a large update is held once: in the buffer it was received into)."""
    if start + rows > batch.rows:
        return None
    views = [layer[start : start + rows] for layer in batch.layers]
    if all(v.flags.c_contiguous and v.ctypes.data % ALIGNMENT == 0 for v in views):
        return views
    return None


def pack(first: Any, capacity: int, staging: Callable[[], list[np.ndarray]],
         more: Callable[[int, float], Any], deadline: float) -> Iterator[Step | Packed]:
    """The steps of ``first`` (a queued work item: ``client``, ``writer``, ``batch``) and of the batches that
    ``more(rows_left, wait_until)`` hands on (None: no more for this shard), in order.

    ``staging()`` gives the staging buffer to fill next (the one no step in flight reads). While a step is less
    than half full, ``more`` may wait until ``deadline`` (``time.monotonic()``) for small batches arriving one by
    one; after that, or with the step half full, it does not wait.
    """
    buffers: list[np.ndarray] | None = None  # the staging buffer being filled (taken when first needed)
    fill, done = 0, []
    weights = np.ones(capacity, np.float32)  # each staged row's batch's weight
    work = first
    while work is not None:
        batch, start, in_place = work.batch, 0, False
        while start < batch.rows:
            whole = aligned_rows(batch, start, capacity) if fill == 0 else None
            if whole is not None:  # a whole step of this batch's own aligned rows: no copy
                if start + capacity == batch.rows:
                    done.append((work.client, work.writer, batch.sequence, batch.rows, batch.nbytes))
                yield Step(whole, capacity, done, staged=False,
                           weights=np.full(capacity, batch.weight, np.float32))
                start, done, in_place = start + capacity, [], True
                continue
            if buffers is None:
                buffers = staging()
            take = min(batch.rows - start, capacity - fill)
            for buf, layer in zip(buffers, batch.layers):
                buf[fill : fill + take] = layer[start : start + take]
            weights[fill : fill + take] = batch.weight
            fill, start = fill + take, start + take
            if fill == capacity and start < batch.rows:  # a batch larger than one step
                yield Step(buffers, fill, done, weights=weights)
                buffers, fill, done, weights = None, 0, [], np.ones(capacity, np.float32)
        yield Packed(batch, in_place)
        if not fill:  # its last rows went in a step of their own: nothing is waiting in staging
            work = more(capacity, 0.0)
            continue
        done.append((work.client, work.writer, batch.sequence, batch.rows, batch.nbytes))
        work = more(capacity - fill, deadline if fill < capacity // 2 else 0.0)
    if fill:
        assert buffers is not None  # (rows were copied into it)
        yield Step(buffers, fill, done, weights=weights)
