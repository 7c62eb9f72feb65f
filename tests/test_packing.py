"""Packing batches into device steps (clipd/server/summing/packing.py) and counting progress (progress.py), alone:
worked examples, no device and no server."""

from __future__ import annotations

import doctest
import types

import numpy as np
import pytest

from clipd.server import progress
from clipd.server.summing import packing
from clipd.server.summing.batch import Batch
from clipd.server.summing.memory import aligned_empty
from clipd.server.summing.packing import Step, pack


def _queued(sequence: int, layer: np.ndarray):
    return types.SimpleNamespace(client=f"c{sequence}", writer="w",
                                 batch=Batch(sequence, len(layer), [layer], layer.nbytes))


def test_the_worked_examples_in_the_docstrings():
    for module in (packing, progress):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__


def test_whole_aligned_steps_go_as_they_are_and_the_rest_is_copied():
    """10 aligned rows at 4 a step: rows 0-3 and 4-7 read in place, rows 8-9 copied with 2 of the next batch's 3
    rows into the staging buffer, its last row in a step of its own; a batch completes in the step that holds its
    last rows."""
    big = aligned_empty((10, 16), np.float32)  # a row is 64 bytes: every row starts aligned
    big[:] = np.arange(160, dtype=np.float32).reshape(10, 16)
    small = np.full((3, 16), -1.0, np.float32)
    staging = [np.zeros((4, 16), np.float32)]
    later = iter([_queued(2, small)])
    asked = []

    def more(rows, wait):
        asked.append(rows)
        return next(later, None)

    items = list(pack(_queued(1, big), 4, lambda: staging, more, deadline=5.0))
    kinds = [(type(i).__name__, i.rows if isinstance(i, Step) else i.batch.sequence) for i in items]
    assert kinds == [("Step", 4), ("Step", 4), ("Packed", 1), ("Step", 4), ("Packed", 2), ("Step", 1)]
    first, second = items[0], items[1]
    assert not first.staged and not second.staged and first.done == [] and second.done == []
    assert np.shares_memory(first.layers[0], big) and np.array_equal(second.layers[0], big[4:8])
    assert items[2].in_place and not items[4].in_place  # the big batch's buffers stay held by its step
    third = items[3]
    assert third.staged and [d[2] for d in third.done] == [1]  # batch 1's last rows are in it
    assert asked == [2, 3]  # room for 2 rows after its tail; then for 3 beside the next batch's last row
    assert [d[2] for d in items[5].done] == [2] and np.array_equal(staging[0][:1], small[2:])


def test_a_step_less_than_half_full_waits_until_the_deadline_and_a_fuller_one_does_not():
    waits = []

    def more(rows, wait):
        waits.append((rows, wait))
        return None

    list(pack(_queued(1, np.ones((1, 2), np.float32)), 8, lambda: [np.zeros((8, 2), np.float32)], more, 7.5))
    list(pack(_queued(1, np.ones((5, 2), np.float32)), 8, lambda: [np.zeros((8, 2), np.float32)], more, 7.5))
    assert waits == [(7, 7.5), (3, 0.0)]


def test_progress_counts_a_rate_over_the_last_seconds():
    p = progress.Progress(created=0.0)
    for second in range(20):
        p.count(rows=10, batches=1, nbytes=40, now=float(second))
    assert (p.examples, p.batches, p.bytes) == (200, 20, 800)
    assert p.rate(now=20.0) == 9.0  # 200 - 110 (counted by second 10) examples in the last 10 seconds
    assert p.rate(now=40.0) == 0.0  # idle for longer than the window


def test_each_row_of_a_step_carries_its_batchs_weight():
    """Batches of weights 0.5, 1 and 0.25 (2, 3 and 2 rows) at 4 rows a step: the first step's rows weigh
    0.5, 0.5, 1, 1, the second's 1, 0.25, 0.25; a whole aligned step weighs its batch's."""
    def weighted(sequence, rows, weight):
        layer = np.full((rows, 16), float(sequence), np.float32)
        return types.SimpleNamespace(client=f"c{sequence}", writer="w",
                                     batch=Batch(sequence, rows, [layer], layer.nbytes, weight=weight))

    later = iter([weighted(2, 3, 1.0), weighted(3, 2, 0.25)])
    steps = [item for item in pack(weighted(1, 2, 0.5), 4, lambda: [np.zeros((4, 16), np.float32)],
                                   lambda rows, wait: next(later, None), deadline=0.0) if isinstance(item, Step)]
    assert [s.weights[:s.rows].tolist() for s in steps] == [[0.5, 0.5, 1.0, 1.0], [1.0, 0.25, 0.25]]
    big = aligned_empty((4, 16), np.float32)
    whole = next(item for item in pack(types.SimpleNamespace(client="c", writer="w", batch=Batch(
        1, 4, [big], big.nbytes, weight=0.75)), 4, lambda: [np.zeros((4, 16), np.float32)], lambda r, w: None,
        deadline=0.0) if isinstance(item, Step))
    assert not whole.staged and whole.weights.tolist() == [0.75] * 4


@pytest.mark.parametrize("stream", ["", "s"])  # a buffered stream's aggregation sums each row times its weight
def test_a_step_a_little_over_a_bucket_runs_as_two_programs_and_sums_what_one_would(stream):
    """270 rows at device_rows 1,024: two programs of 256 rows (512 read, not 1,024), each row clipped to
    C = 1 and summed (times its weight), the padding rows' garbage masked out, against numpy in float64."""
    from clipd.engine import ClipPolicy, LayerSpec
    from clipd.server.aggregations import Aggregation, AggregationSpec
    from clipd.server.summing.slots import ShardSlot

    layers = (LayerSpec("w", (4, 3)), LayerSpec("b", (5,)))
    aggregation = Aggregation("a", AggregationSpec(layers, ClipPolicy(l2_norm_clip=1.0), stream=stream), 1024,
                              1 << 24)
    rng = np.random.default_rng(7)
    staging = [np.full((1024, 4, 3), 1e30, np.float32), np.full((1024, 5), np.nan, np.float32)]
    rows = [rng.standard_normal((270, 4, 3), dtype=np.float32), rng.standard_normal((270, 5), dtype=np.float32)]
    rows[0][::3] *= 0.01  # a third of the rows under the bound
    staging[0][:270], staging[1][:270] = rows
    weights = np.ones(1024, np.float32)
    weights[:270] = rng.uniform(0.1, 1.0, 270) if stream else 1.0
    slot = ShardSlot(aggregation.accumulator.init())
    assert slot.run(aggregation, Step(staging, 270, [], weights=weights)) == (None, None)
    assert slot.steps == 2  # two programs
    totals = slot.absorb_into(aggregation, 0, restart=False)

    flat = np.concatenate([r.reshape(270, -1) for r in rows], axis=1).astype(np.float64)
    scale = np.minimum(1.0, 1.0 / np.linalg.norm(flat, axis=1)) * weights[:270]
    expected = (flat * scale[:, None]).sum(axis=0)
    np.testing.assert_allclose(np.concatenate([np.ravel(s) for s in totals.sums]), expected, rtol=1e-5, atol=1e-5)
    assert totals.examples == 270
