"""An audit's canaries as contributions: through the aggregation's unit, clip and step, as its data goes.

A canary is a contribution whose vector has one coordinate in each of its layers and zeros elsewhere
(``engine._audit``). The server's data path for a contribution is: the unit's rows (``contribution_rows``:
under the client unit a client's rows summed into one), then the aggregation's accumulator: the norm of each
row (over its whole vector, or each layer's), the multiplier against the bounds, and the step that scales and
sums the rows. :func:`clip_and_sum` sends the canaries down that same path, on rows that keep only the
coordinates canaries use (``ClipAccumulator.on_support``: the same bounds, computed for the whole layers, and
the same step; zeros elsewhere change no norm), so an audit costs ``O(N)`` per release whatever the model's
size. The kind of step mirrors the data's: ``GROUP`` rows in one step where the aggregation's steps take
several rows; one row a step where they take one (a large model), the step's state carried from row to row as
a shard's delta is, measured and added into float64 totals on the host where its sums are there
(``Aggregation.sums_on_host``); on the secure grid in fixed point where its sums are.

What each canary's clip added is read back per canary: in a group of ``GROUP`` canaries each has a column of
its own in every layer, so a column's sum is its canary's clipped value there.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from clipd.engine import Unit, add_example, contribution_rows
from clipd.engine._audit import CanaryLayout, CanaryVectors
from clipd.server.aggregations import Aggregation

GROUP = 128  # canaries in one step where the aggregation's steps take several rows (one compiled program)


def clip_and_sum(aggregation: Aggregation, layout: CanaryLayout, vectors: CanaryVectors,
                 added: np.ndarray) -> tuple[np.ndarray, ...]:
    """What the aggregation's unit, clip and step add for each canary of ``added`` (bool, 2N): per layer, per
    member of it (``layout.members[k]``), float64; 0 for the canaries not added."""
    client = aggregation.unit is Unit.CLIENT
    one_at_a_time = aggregation.device_rows == 1
    on_host = aggregation.sums_on_host(jax.default_backend())
    accumulator = aggregation.accumulator.on_support([GROUP] * len(layout.members))
    dtypes = [np.dtype(layer.dtype) for layer in aggregation.layers]
    member_index = [_inverse(members, layout.count) for members in layout.members]
    out = [np.zeros(members.size) for members in layout.members]
    which = np.flatnonzero(added)
    for start in range(0, which.size, GROUP):
        chunk = which[start:start + GROUP]
        rows = layout.rows[chunk] if client else np.ones(chunk.size, np.int64)
        batch = _batch(chunk, rows, vectors.rows, member_index, dtypes, GROUP)
        contributions = contribution_rows(aggregation.unit, batch, rows.tolist() if client else None)
        sums = _step(accumulator, contributions, one_at_a_time, on_host, aggregation.weighted)
        for k, index in enumerate(member_index):
            j = index[chunk]
            has = j >= 0
            out[k][j[has]] = sums[k][np.flatnonzero(has)]
    return tuple(out)


def _inverse(members: np.ndarray, count: int) -> np.ndarray:
    """int64 (count,): each canary's index among ``members`` (-1: it has no coordinate in that layer)."""
    index = np.full(count, -1, np.int64)
    index[members] = np.arange(members.size)
    return index


def _batch(chunk: np.ndarray, rows: np.ndarray, member_rows: Sequence[np.ndarray], member_index: list[np.ndarray],
           dtypes: Sequence[np.dtype], width: int) -> list[np.ndarray]:
    """The chunk's rows, canary after canary (``rows[j]`` each), canary ``j``'s values in column ``j`` of every
    layer it has a coordinate in, zeros elsewhere."""
    first = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
    column = np.arange(chunk.size)
    batch = []
    for values, index, dtype in zip(member_rows, member_index, dtypes):
        layer = np.zeros((int(rows.sum()), width), dtype)
        j = index[chunk]
        for r in range(values.shape[1]):
            has = (j >= 0) & (r < rows)
            layer[first[has] + r, column[has]] = values[j[has], r]
        batch.append(layer)
    return batch


def _step(accumulator, contributions: list[np.ndarray], one_at_a_time: bool, on_host: bool, weighted: bool
          ) -> list[np.ndarray]:
    """The clipped sum of ``contributions`` (one row each) per column, float64, by the kind of step the
    aggregation's data takes: one row a step, its state carried from step to step as a shard's delta is (measured
    and added into float64 totals on the host, or summed into the device delta), or every row in one step padded
    to ``GROUP`` rows (the padding invalid: it adds exactly nothing). ``weighted``: the steps that take weights
    (a buffered stream's), each canary's 1."""
    n = contributions[0].shape[0]
    one = np.ones(1, np.float32) if weighted else None
    if one_at_a_time and on_host:
        state, measured = accumulator.init(sums=False), []
        for r in range(n):
            state, scales = accumulator.measure(state, [c[r:r + 1] for c in contributions], np.ones(1, bool), one)
            measured.append(scales)
        totals = [np.zeros(c.shape[1]) for c in contributions]
        for r, scales in enumerate(jax.device_get(measured)):
            add_example(totals, [c[r] for c in contributions], scales)
        return totals
    if one_at_a_time:
        state = accumulator.init()
        for r in range(n):
            state = accumulator.update(state, [c[r:r + 1] for c in contributions], np.ones(1, bool), weights=one)
        return [np.asarray(s, np.float64) for s in state.sums]
    rows = max(n, GROUP)
    padded = [np.concatenate([c, np.zeros((rows - n, c.shape[1]), c.dtype)]) if n < rows else c
              for c in contributions]
    state = accumulator.update(accumulator.init(), padded, np.arange(rows) < n,
                               weights=np.ones(rows, np.float32) if weighted else None)
    return [np.asarray(s, np.float64) for s in state.sums]
