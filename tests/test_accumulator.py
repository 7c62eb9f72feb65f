"""The streaming accumulator against optax / jax_privacy on the concatenated batch."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_close, global_norms, layer_shapes, random_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from jax_privacy import clipping as jp

from clipd.engine import (
    CHUNK_ELEMENTS,
    NUM_BUCKETS,
    BoundKind,
    ClipAccumulator,
    ClipPolicy,
    ExampleScales,
    LayerSpec,
    NonFinite,
    Tricks,
    add_example,
    merge,
    sum_buffer_runs,
)


def make_acc(batch, policy, dtype=None, tricks=Tricks()):  # noqa: B008 (a NamedTuple: immutable)
    specs = [LayerSpec(f"l{k}", x.shape[1:], dtype or str(x.dtype)) for k, x in enumerate(batch)]
    return ClipAccumulator(specs, policy, tricks)


def stream(acc, batch, chunk=5, bucket=8, garbage=np.nan, state=None):
    """Feeds ``batch`` in chunks of ``chunk`` rows, each padded to ``bucket`` rows of garbage."""
    state = acc.init() if state is None else state
    n = batch[0].shape[0]
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        padded = []
        for x in batch:
            p = np.full((bucket, *x.shape[1:]), garbage, dtype=x.dtype)
            p[:rows] = x[start : start + rows]
            padded.append(p)
        state = acc.update(state, padded, np.arange(bucket) < rows)
    return state


def to_np(state):
    return jax.tree.map(np.asarray, state)


COUNT_FIELDS = ("example_count", "non_finite_count", "clip_counts", "layer_norm_histogram", "example_norm_histogram")
FLOAT_FIELDS = ("norm_sum", "norm_max")


def assert_same_state(a, b, rtol=1e-6, atol=0.0):
    """Counts equal exactly; sums and norm statistics equal up to float rounding."""
    for name in COUNT_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name)
    for name in FLOAT_FIELDS:
        np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=rtol, atol=atol, err_msg=name)
    for x, y in zip(a.sums, b.sums, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def typical_bound(batch):
    return float(np.median(global_norms(batch))) * 1.01


@pytest.mark.parametrize("num_layers", [1, 4, 17])
@pytest.mark.parametrize("bound", [0.0, None, 1e6, math.inf])
@pytest.mark.parametrize(
    "kind", [BoundKind.GLOBAL, BoundKind.PER_LAYER_UNIFORM, BoundKind.PER_LAYER_PROPORTIONAL]
)
def test_stream_matches_optax(kind, bound, num_layers):
    rng = np.random.default_rng(num_layers)
    batch = random_batch(rng, 37, layer_shapes(num_layers, rng))
    c = typical_bound(batch) if bound is None else bound
    acc = make_acc(batch, ClipPolicy(kind, l2_norm_clip=c))
    state = to_np(stream(acc, batch))
    grads = [jnp.asarray(x) for x in batch]
    if kind is BoundKind.GLOBAL:
        ref_sums, ref_count = optax.per_example_global_norm_clip(grads, c)
        ref_counts = [ref_count] * num_layers
    else:
        uniform = kind is BoundKind.PER_LAYER_UNIFORM
        ref_sums, ref_counts = optax.per_example_layer_norm_clip(grads, c, uniform=uniform)
    for ours, ref in zip(state.sums, ref_sums):
        assert_close(ours, ref)
    assert state.clip_counts.tolist() == [int(r) for r in ref_counts]
    assert int(state.example_count) == 37
    assert int(state.non_finite_count) == 0


def test_explicit_layer_bounds_match_optax_per_layer():
    rng = np.random.default_rng(3)
    batch = random_batch(rng, 20, [(3, 4), (6,), (2, 2, 2)])
    bounds = (0.5, 2.0, math.inf)
    state = to_np(stream(make_acc(batch, ClipPolicy(BoundKind.PER_LAYER_EXPLICIT, layer_clips=bounds)), batch))
    for k, (x, c) in enumerate(zip(batch, bounds)):
        (ref,), count = optax.per_example_global_norm_clip([jnp.asarray(x)], c)
        assert_close(state.sums[k], ref)
        assert state.clip_counts[k] == int(count)


@pytest.mark.parametrize("kind", [BoundKind.GLOBAL, BoundKind.PER_LAYER_UNIFORM])
def test_layers_in_several_sum_buffers_match_optax(kind):
    # Small layers share a sum buffer, a layer over CHUNK_ELEMENTS has its own: 3 buffers here.
    big = CHUNK_ELEMENTS + 3
    shapes = [(4,), (2, 3), (big,), (5,), (1,)]
    assert len(sum_buffer_runs([math.prod(s) for s in shapes])) == 3
    rng = np.random.default_rng(31)
    batch = random_batch(rng, 9, shapes)
    c = typical_bound(batch)
    state = to_np(stream(make_acc(batch, ClipPolicy(kind, l2_norm_clip=c)), batch, chunk=4, bucket=4))
    grads = [jnp.asarray(x) for x in batch]
    if kind is BoundKind.GLOBAL:
        ref_sums, count = optax.per_example_global_norm_clip(grads, c)
        ref_counts = [int(count)] * len(shapes)
    else:
        ref_sums, ref_counts = optax.per_example_layer_norm_clip(grads, c, uniform=True)
    for ours, ref in zip(state.sums, ref_sums, strict=True):
        assert ours.shape == ref.shape
        assert_close(ours, ref)
    assert state.clip_counts.tolist() == [int(r) for r in ref_counts]


def test_several_sum_buffers_merge_and_decode_alike_on_device_and_host():
    shapes = [(3,), (CHUNK_ELEMENTS + 1,), (2, 2)]
    rng = np.random.default_rng(32)
    batch = random_batch(rng, 12, shapes)
    acc = make_acc(batch, ClipPolicy(BoundKind.PER_LAYER_PROPORTIONAL, l2_norm_clip=typical_bound(batch)))
    whole = stream(acc, batch, chunk=4, bucket=4)
    merged = merge(stream(acc, [x[:5] for x in batch], chunk=4, bucket=4),
                   stream(acc, [x[5:] for x in batch], chunk=4, bucket=4))
    assert len(whole.sum_chunks) == 3
    assert_same_state(to_np(merged), to_np(whole), rtol=1e-5, atol=1e-6)
    # The properties decode device arrays and their host copies to the same values.
    assert_same_state(whole, to_np(whole), rtol=0.0)
    assert [s.shape for s in whole.sums] == shapes


@pytest.mark.parametrize("tricks", [Tricks()._replace(**{name: False}) for name in Tricks._fields]
                         + [Tricks(*(False for _ in Tricks._fields))])
@pytest.mark.parametrize("mode", list(NonFinite))
def test_layout_tricks_change_no_bit(tricks, mode):
    # Two small layers share a sum buffer with all tricks on; garbage padding and NaN/inf rows take
    # the cleaning branch. Switching a trick off changes the buffers or the program, not one bit of the result.
    batch = random_batch(np.random.default_rng(33), 12, [(3,), (2, 2), (CHUNK_ELEMENTS + 1,), (5,)])
    policy = ClipPolicy(BoundKind.PER_LAYER_UNIFORM, l2_norm_clip=typical_bound(batch), non_finite=mode)
    batch[0][2, 1], batch[2][7, 5] = np.nan, np.inf
    states = [stream(make_acc(batch, policy, tricks=t), batch, chunk=5, bucket=8) for t in (Tricks(), tricks)]
    assert jax.tree.structure(states[0]) != jax.tree.structure(states[1])
    for a, b in [states, [merge(s, s) for s in states], [to_np(s.statistics_only()) for s in states]]:
        for name in (*COUNT_FIELDS, *FLOAT_FIELDS, *(("sums",) if a.sum_chunks is not None else ())):
            for x, y in zip(*(jax.tree.leaves(getattr(s, name)) for s in (a, b)), strict=True):
                x, y = np.asarray(x), np.asarray(y)
                assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), name


@pytest.mark.parametrize("bound", [0.0, 1.5, math.inf])
@pytest.mark.parametrize("kind", [BoundKind.GLOBAL, BoundKind.PER_LAYER_UNIFORM])
def test_rescale_to_unit_norm_matches_jax_privacy(kind, bound):
    rng = np.random.default_rng(4)
    batch = random_batch(rng, 12, [(4,), (2, 3)])
    acc = make_acc(batch, ClipPolicy(kind, l2_norm_clip=bound, rescale_to_unit_norm=True))
    state = to_np(stream(acc, batch))
    clip = lambda tree, c: jp.clip_pytree(tree, c, rescale_to_unit_norm=True)[0]  # noqa: E731
    grads = [jnp.asarray(x) for x in batch]
    if kind is BoundKind.GLOBAL:
        ref = [x.sum(0) for x in jax.vmap(lambda ex: clip(ex, bound))(grads)]
    else:
        ref = [jax.vmap(lambda ex, c=c: clip(ex, c))(x).sum(0) for x, c in zip(grads, acc.bounds)]
    for ours, r in zip(state.sums, ref):
        assert_close(ours, r)


def _batch_with_bad_rows(rng):
    batch = random_batch(rng, 16, [(5,), (2, 3)])
    batch[0][3, 1] = np.nan
    batch[1][7, 0, 2] = np.inf
    batch[0][11, :] = -np.inf
    return batch, [3, 7, 11]


@pytest.mark.parametrize("kind", [BoundKind.GLOBAL, BoundKind.PER_LAYER_UNIFORM])
def test_non_finite_zero_example_drops_and_counts(kind):
    batch, bad = _batch_with_bad_rows(np.random.default_rng(5))
    c = 2.0
    state = to_np(stream(make_acc(batch, ClipPolicy(kind, l2_norm_clip=c)), batch))
    good = [np.delete(x, bad, axis=0) for x in batch]
    fn = optax.per_example_global_norm_clip if kind is BoundKind.GLOBAL else optax.per_example_layer_norm_clip
    ref_sums, ref_counts = fn([jnp.asarray(x) for x in good], c)
    for ours, ref in zip(state.sums, ref_sums):
        assert_close(ours, ref)
    ref_counts = [ref_counts] * 2 if kind is BoundKind.GLOBAL else ref_counts
    assert state.clip_counts.tolist() == [int(r) for r in ref_counts]
    assert int(state.non_finite_count) == 3
    assert int(state.example_count) == 16
    assert int(state.layer_norm_histogram.sum()) == 2 * 13  # the bad rows are not in the statistics


def test_non_finite_zero_entries_matches_nan_safe_clip_pytree():
    batch, _ = _batch_with_bad_rows(np.random.default_rng(6))
    c = 2.0
    state = to_np(stream(make_acc(batch, ClipPolicy(l2_norm_clip=c, non_finite=NonFinite.ZERO_ENTRIES)), batch))
    clipped, norms = jax.vmap(lambda ex: jp.clip_pytree(ex, c, nan_safe=True))([jnp.asarray(x) for x in batch])
    for ours, ref in zip(state.sums, clipped):
        assert_close(ours, ref.sum(0))
    assert state.clip_counts[0] == int(np.sum(np.asarray(norms) > c))
    assert int(state.non_finite_count) == 3


def test_non_finite_propagate_matches_optax():
    batch, _ = _batch_with_bad_rows(np.random.default_rng(7))
    state = to_np(stream(make_acc(batch, ClipPolicy(l2_norm_clip=2.0, non_finite=NonFinite.PROPAGATE)), batch))
    ref_sums, ref_count = optax.per_example_global_norm_clip([jnp.asarray(x) for x in batch], 2.0)
    for ours, ref in zip(state.sums, ref_sums):
        assert_close(ours, ref)  # NaN in the same places, the rest equal
    assert np.isnan(state.sums[0]).any()
    assert state.clip_counts[0] == int(ref_count)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_input_accumulates_in_float32(dtype):
    rng = np.random.default_rng(8)
    batch = random_batch(rng, 64, [(8,), (3, 5)], dtype=dtype, spread=1.0)
    c = typical_bound(batch)
    state = to_np(stream(make_acc(batch, ClipPolicy(l2_norm_clip=c)), batch, chunk=16, bucket=16))
    # Independent float64 reference on the same (low-precision) values.
    x64 = [np.asarray(x).astype(np.float64) for x in batch]
    m = np.minimum(1.0, c / global_norms(batch))
    for ours, x in zip(state.sums, x64):
        assert ours.dtype == np.float32
        np.testing.assert_allclose(ours, np.tensordot(m, x, axes=1), rtol=1e-5, atol=1e-5 * np.abs(x).max())


def test_float64_under_x64():
    with jax.enable_x64(True):
        rng = np.random.default_rng(9)
        batch = random_batch(rng, 10, [(3,), (2, 2)], dtype="float64")
        state = to_np(stream(make_acc(batch, ClipPolicy(l2_norm_clip=1.0)), batch))
        ref_sums, ref_count = optax.per_example_global_norm_clip([jnp.asarray(x) for x in batch], 1.0)
        for ours, ref in zip(state.sums, ref_sums):
            assert_close(ours, ref, "float64")
        assert state.clip_counts[0] == int(ref_count)


@pytest.mark.parametrize("garbage", [np.nan, np.inf, 1e30, -7.0])
@pytest.mark.parametrize("mode", list(NonFinite))
def test_padding_contributes_exactly_zero(garbage, mode):
    rng = np.random.default_rng(10)
    batch = random_batch(rng, 11, [(4,), (3, 2)])
    acc = make_acc(batch, ClipPolicy(BoundKind.PER_LAYER_UNIFORM, l2_norm_clip=1.0, non_finite=mode))
    # A batch of padding only leaves the state exactly as it was.
    only_padding = [np.full((8, *x.shape[1:]), garbage, x.dtype) for x in batch]
    state = to_np(acc.update(acc.init(), only_padding, np.zeros(8, bool)))
    for leaf in jax.tree.leaves(state):  # the raw buffers: all bits zero
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
    # Padded with garbage or with zeros: the same counts, and sums equal up to summation order
    # (non-finite padding takes the select-first code path).
    with_garbage = to_np(stream(acc, batch, chunk=3, bucket=8, garbage=garbage))
    with_zeros = to_np(stream(acc, batch, chunk=3, bucket=8, garbage=0.0))
    assert_same_state(with_garbage, with_zeros)
    assert int(with_garbage.example_count) == 11


def test_histogram_and_norm_statistics_worked_example():
    # One layer, C = 1: norms 0, 0.5, 1 (a tie), 2, 100.
    x = np.array([[0, 0], [0.3, 0.4], [0.6, 0.8], [1.2, 1.6], [60, 80]], np.float32)
    state = to_np(stream(make_acc([x], ClipPolicy(l2_norm_clip=1.0)), [x], chunk=5, bucket=8))
    expected = np.zeros(NUM_BUCKETS, int)
    expected[[0, 4, 7, 10, 15]] = 1  # edges ... 1/2 (4) ... 1.0 (7) ... 2.0 (10) ... >64 (15)
    np.testing.assert_array_equal(state.layer_norm_histogram[0], expected)
    np.testing.assert_array_equal(state.example_norm_histogram, expected)
    np.testing.assert_allclose(state.norm_sum, [103.5], rtol=1e-6)
    np.testing.assert_allclose(state.norm_max, [100.0], rtol=1e-6)
    assert state.clip_counts.tolist() == [2]  # the tie is not clipped


def test_merge_of_partial_states_equals_whole_stream():
    rng = np.random.default_rng(11)
    batch = random_batch(rng, 40, [(6,), (2, 3)])
    acc = make_acc(batch, ClipPolicy(BoundKind.PER_LAYER_PROPORTIONAL, l2_norm_clip=typical_bound(batch)))
    whole = to_np(stream(acc, batch))
    first, second = [x[:17] for x in batch], [x[17:] for x in batch]
    merged = to_np(merge(stream(acc, first), stream(acc, second)))
    assert_same_state(merged, whole, rtol=1e-5, atol=1e-6)


def test_no_recompilation_after_warm_up():
    rng = np.random.default_rng(12)
    batch = random_batch(rng, 64, [(5,), (3, 3)])
    buckets = [1, 2, 4, 8, 16, 32, 64]
    acc = make_acc(batch, ClipPolicy(l2_norm_clip=1.0))
    state = acc.init()
    for b in buckets:  # warm-up
        state = acc.update(state, [x[:b] for x in batch], np.zeros(b, bool))
    compiled = ClipAccumulator.compiled_programs()
    for n in range(1, 65):
        b = next(b for b in buckets if b >= n)
        state = acc.update(state, [x[:b] for x in batch], np.arange(b) < n)
    # Another aggregation with the same layers but another bound reuses the programs.
    other = make_acc(batch, ClipPolicy(l2_norm_clip=7.0))
    other.update(other.init(), [x[:8] for x in batch], np.ones(8, bool))
    assert ClipAccumulator.compiled_programs() == compiled
    assert int(state.example_count) == 64 * 65 // 2


_backend_compiles: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: _backend_compiles.append(event) if "backend_compile" in event else None)


@pytest.mark.parametrize("kind, weighted", [("sum", False), ("fresh", False), ("measure", False), ("sum", True),
                                            ("measure", True)])
def test_steps_compiled_ahead_of_time_from_shapes_run_without_compiling(kind, weighted):
    # A large model's warm-up compiles its steps from shapes alone (no model-sized batch of zeros is made and run):
    # the worker's first step, with numpy batches on the same default device, must find the program compiled.
    acc = ClipAccumulator([LayerSpec("w", (3, 5)), LayerSpec("b", (7,))], ClipPolicy(l2_norm_clip=2.5 + weighted))
    rng = np.random.default_rng(3)
    batch = [rng.standard_normal((16, 3, 5), dtype=np.float32), rng.standard_normal((16, 7), dtype=np.float32)]
    weights = np.full(16, 0.5, np.float32) if weighted else None
    with jax.default_device(jax.devices()[0]):
        acc.compile(16, kind, weighted)
        compiled = len(_backend_compiles)
        assert compiled > 0  # (the listener hears this jax's compiles)
        if kind == "measure":
            state, scales = acc.measure(acc.init(sums=False), batch, np.ones(16, bool), weights)
            jax.block_until_ready(scales)
        else:
            state = jax.block_until_ready(acc.update(acc.init(), batch, np.ones(16, bool), kind == "fresh", weights))
    assert _backend_compiles[compiled:] == []
    assert int(state.example_count) == 16
    with pytest.raises(ValueError, match="kind"):
        acc.compile(16, "sums")


def test_state_is_donated():
    x = np.ones((4, 3), np.float32)
    acc = make_acc([x], ClipPolicy())
    state = acc.init()
    new = acc.update(state, [x], np.ones(4, bool))
    assert state.sum_chunks[0].is_deleted() and state.stats.is_deleted()
    assert not new.sum_chunks[0].is_deleted()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(l2_norm_clip=-1.0),
        dict(l2_norm_clip=math.nan),
        dict(kind=BoundKind.PER_LAYER_EXPLICIT),
        dict(kind=BoundKind.PER_LAYER_EXPLICIT, layer_clips=(1.0, -2.0)),
        dict(kind=BoundKind.GLOBAL, layer_clips=(1.0,)),
        dict(kind="no_such_kind"),
        dict(non_finite="ignore"),
    ],
)
def test_invalid_policies_raise(kwargs):
    with pytest.raises(ValueError):
        ClipPolicy(**kwargs)


def test_explicit_bounds_must_match_layer_count():
    with pytest.raises(ValueError, match="2 bounds for 3 layers"):
        ClipAccumulator([LayerSpec(n, (2,)) for n in "abc"], ClipPolicy("per_layer_explicit", layer_clips=(1, 2)))


# Properties. One fixed layer spec so that Hypothesis does not trigger recompilations.
SPEC_SHAPES = [(3,), (2, 2)]
rows = st.lists(
    st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=7, max_size=7),
    min_size=1,
    max_size=8,
).map(lambda r: np.asarray(r, np.float32))
policies = st.builds(
    ClipPolicy,
    kind=st.sampled_from([BoundKind.GLOBAL, BoundKind.PER_LAYER_UNIFORM]),
    l2_norm_clip=st.sampled_from([0.0, 0.1, 1.0, 10.0, math.inf]),
    rescale_to_unit_norm=st.booleans(),
)


def _layers(flat):
    return [flat[:, :3], flat[:, 3:].reshape(-1, 2, 2)]


def _run(policy, flat, bucket=8):
    batch = _layers(flat)
    return to_np(stream(make_acc(batch, policy), batch, chunk=bucket, bucket=bucket))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(flat=rows, policy=policies, seed=st.integers(0, 2**16))
def test_sum_is_permutation_invariant(flat, policy, seed):
    perm = np.random.default_rng(seed).permutation(len(flat))
    a, b = _run(policy, flat), _run(policy, flat[perm])
    for x, y in zip(a.sums, b.sums):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(a.clip_counts, b.clip_counts)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(flat=rows, policy=policies)
def test_each_clipped_example_is_within_its_bound(flat, policy):
    acc = make_acc(_layers(flat), policy)
    for row in flat:  # a one-example stream's sum is that example, clipped
        state = to_np(stream(acc, _layers(row[None]), chunk=1, bucket=1))
        norms = [np.linalg.norm(s) for s in state.sums]
        limits = [1.0] * len(acc.bounds) if policy.rescale_to_unit_norm else acc.bounds
        if policy.is_per_layer:
            assert all(n <= lim * (1 + 1e-5) for n, lim in zip(norms, limits))
        else:
            assert math.hypot(*norms) <= limits[0] * (1 + 1e-5)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(flat=rows, policy=policies, cut=st.integers(0, 8))
def test_split_batches_merge_to_the_whole(flat, policy, cut):
    cut = min(cut, len(flat))
    whole = _run(policy, flat)
    parts = [_run(policy, part) for part in (flat[:cut], flat[cut:]) if len(part)]
    merged = parts[0] if len(parts) == 1 else to_np(merge(*parts))
    for x, y in zip(merged.sums, whole.sums):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(merged.clip_counts, whole.clip_counts)
    np.testing.assert_array_equal(merged.layer_norm_histogram, whole.layer_norm_histogram)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(flat=rows, policy=policies)
def test_jit_equals_eager(flat, policy):
    jitted = _run(policy, flat)
    with jax.disable_jit():
        eager = _run(policy, flat)
    assert_same_state(jitted, eager, rtol=1e-5, atol=1e-5)


garbage_values = st.sampled_from([0.0, 1.0, -3.5, 1e30, np.nan, np.inf, -np.inf])


@settings(max_examples=25, deadline=None, derandomize=True)
@given(flat=rows, policy=policies, garbage=garbage_values)
def test_padding_rows_never_change_the_result(flat, policy, garbage):
    batch = _layers(flat)
    acc = make_acc(batch, policy)
    unpadded = to_np(stream(acc, batch, chunk=8, bucket=8, garbage=0.0))
    padded = to_np(stream(acc, batch, chunk=3, bucket=8, garbage=garbage))
    assert_same_state(padded, unpadded, rtol=1e-5, atol=1e-4)


# One example a step, summed on the host (a large model's path on the CPU) ----------------------------------
def measure_and_add(acc, batch, valid=None):
    """Each example of ``batch`` measured alone, then added into float64 totals on the host."""
    totals = [np.zeros(x.shape[1:], np.float64) for x in batch]
    state = acc.init(sums=False)
    for i in range(batch[0].shape[0]):
        example = [x[i : i + 1] for x in batch]
        ok = np.array([True if valid is None else valid[i]])
        state, scales = acc.measure(state, example, ok)
        add_example(totals, example, jax.device_get(scales))
    return to_np(state), totals


def fresh_then_flush(acc, batch, valid=None):
    """The device path it replaces: each example into a fresh delta, the delta added into float64 totals."""
    totals = [np.zeros(x.shape[1:], np.float64) for x in batch]
    state, stats = acc.init(), acc.init()
    for i in range(batch[0].shape[0]):
        ok = np.array([True if valid is None else valid[i]])
        state = acc.update(state, [x[i : i + 1] for x in batch], ok, fresh=True)
        for total, s in zip(totals, jax.device_get(state).sums):
            np.add(total, s, out=total)
        stats = acc.merge(stats, state)
    return to_np(stats), totals


POLICIES = [
    ClipPolicy(l2_norm_clip=2.0),
    ClipPolicy(BoundKind.PER_LAYER_UNIFORM, l2_norm_clip=1.0),
    ClipPolicy(BoundKind.PER_LAYER_PROPORTIONAL, l2_norm_clip=1.5),
    ClipPolicy(l2_norm_clip=1.5, rescale_to_unit_norm=True),
    ClipPolicy(l2_norm_clip=0.0),
    ClipPolicy(l2_norm_clip=2.0, non_finite=NonFinite.ZERO_ENTRIES),
    ClipPolicy(BoundKind.PER_LAYER_UNIFORM, l2_norm_clip=1.0, non_finite=NonFinite.ZERO_ENTRIES),
    ClipPolicy(l2_norm_clip=2.0, non_finite=NonFinite.PROPAGATE),
]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.kind.value}-{p.non_finite.value}-{p.l2_norm_clip}"
                         + ("-unit" if p.rescale_to_unit_norm else ""))
def test_examples_measured_then_added_on_the_host_are_bit_identical_to_the_device_delta(policy):
    batch, _ = _batch_with_bad_rows(np.random.default_rng(21))
    batch[1][5] *= 1e20  # finite entries whose squared norm overflows float32
    acc = make_acc(batch, policy)
    valid = np.ones(16, bool)
    valid[9] = False  # a padding row
    measured, totals = measure_and_add(acc, batch, valid)
    flushed, reference = fresh_then_flush(acc, batch, valid)
    for ours, ref in zip(totals, reference, strict=True):
        assert ours.dtype == np.float64
        assert ours.tobytes() == ref.tobytes()  # NaN where the device path has NaN, every other bit equal
    for name in COUNT_FIELDS + FLOAT_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(measured, name)), np.asarray(getattr(flushed, name)), name)
    assert measured.sum_chunks is None  # the measuring state holds no buffer the size of the model


@pytest.mark.parametrize("kind", [BoundKind.GLOBAL, BoundKind.PER_LAYER_UNIFORM])
def test_examples_added_on_the_host_match_optax(kind):
    rng = np.random.default_rng(22)
    batch = random_batch(rng, 9, [(300,), (7, 5)])
    c = typical_bound(batch)
    state, totals = measure_and_add(make_acc(batch, ClipPolicy(kind, l2_norm_clip=c)), batch)
    fn = optax.per_example_global_norm_clip if kind is BoundKind.GLOBAL else optax.per_example_layer_norm_clip
    ref_sums, ref_counts = fn([jnp.asarray(x) for x in batch], c)
    for ours, ref in zip(totals, ref_sums):
        assert_close(ours.astype(np.float32), ref)
    ref_counts = [ref_counts] * 2 if kind is BoundKind.GLOBAL else ref_counts
    assert state.clip_counts.tolist() == [int(r) for r in ref_counts]
    assert int(state.example_count) == 9


def test_examples_added_on_the_host_match_nan_safe_clip_pytree_and_skip_dropped_examples():
    batch, bad = _batch_with_bad_rows(np.random.default_rng(23))
    c = 2.0
    _, totals = measure_and_add(make_acc(batch, ClipPolicy(l2_norm_clip=c, non_finite=NonFinite.ZERO_ENTRIES)), batch)
    clipped, _ = jax.vmap(lambda ex: jp.clip_pytree(ex, c, nan_safe=True))([jnp.asarray(x) for x in batch])
    for ours, ref in zip(totals, clipped):
        assert_close(ours.astype(np.float32), ref.sum(0))
    state, totals = measure_and_add(make_acc(batch, ClipPolicy(l2_norm_clip=c)), batch)  # ZERO_EXAMPLE
    ref_sums, _ = optax.per_example_global_norm_clip([jnp.asarray(np.delete(x, bad, 0)) for x in batch], c)
    for ours, ref in zip(totals, ref_sums):
        assert_close(ours.astype(np.float32), ref)
    assert int(state.non_finite_count) == 3


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_examples_added_on_the_host_are_products_rounded_to_float32(dtype):
    rng = np.random.default_rng(24)
    batch = random_batch(rng, 5, [(1000,)], dtype=dtype, spread=1.0)
    c = typical_bound(batch)
    _, totals = measure_and_add(make_acc(batch, ClipPolicy(l2_norm_clip=c)), batch)
    x = np.asarray(batch[0]).astype(np.float64)
    m = np.minimum(1.0, c / global_norms(batch)).astype(np.float32)
    # By hand: each product m_i * x_i in float32, the five summed in float64 (m from float64 norms here).
    expected = np.zeros(1000)
    for i in range(5):
        expected += (m[i] * x[i].astype(np.float32)).astype(np.float32)
    assert totals[0].dtype == np.float64
    np.testing.assert_allclose(totals[0], expected, rtol=0, atol=1e-6 * np.abs(expected).max())


def test_add_example_refuses_a_layer_of_another_size_and_measure_refuses_fixed_point():
    with pytest.raises(ValueError, match="3 elements into totals of 4"):
        add_example([np.zeros(4)], [np.ones(3, np.float32)], ExampleScales(np.ones(1, np.float32), np.zeros(1)))
    acc = ClipAccumulator([LayerSpec("w", (4,))], ClipPolicy(l2_norm_clip=1.0), fixed_point_step=2.0 ** -10)
    with pytest.raises(ValueError, match="fixed-point"):
        acc.measure(acc.init(sums=False), [np.ones((1, 4), np.float32)], np.ones(1, bool))


@pytest.mark.parametrize("path, kind", [(p, k) for p in ("batch", "one_row", "measured")
                                         for k in ("global", "per_layer_uniform")] + [("fixed_point", "global")])
def test_weights_scale_each_rows_clipped_contribution_and_leave_the_statistics(path, kind):
    """Per-row weights in [0, 1] (staleness): the sum is sum_i w_i * clip(x_i), the clip optax's
    (per_example_global_norm_clip, or per_example_layer_norm_clip for uniform per-layer bounds), on every step
    path (several rows, one row, measured and added on the host, fixed point on a grid); the clip counts and
    histograms are those of the unweighted rows."""
    rng = np.random.default_rng(3)
    rows = 6 if path == "batch" else 1
    batch = [rng.normal(size=(rows, 5, 3)).astype(np.float32), rng.normal(size=(rows, 4)).astype(np.float32)]
    weights = rng.uniform(0.0, 1.0, size=rows).astype(np.float32)
    layers = [LayerSpec("a", (5, 3)), LayerSpec("b", (4,))]
    policy = ClipPolicy(BoundKind(kind), l2_norm_clip=1.5)
    if kind == "global":
        per_row = [np.stack([optax.per_example_global_norm_clip([jnp.asarray(b[i:i + 1]) for b in batch], 1.5)[0][k]
                             for i in range(rows)]) for k in range(2)]
    else:
        per_row = [np.stack([optax.per_example_layer_norm_clip([jnp.asarray(b[i:i + 1]) for b in batch], 1.5,
                                                               uniform=True)[0][k] for i in range(rows)])
                   for k in range(2)]
    expected = [np.tensordot(weights.astype(np.float64), np.asarray(r, np.float64), axes=1) for r in per_row]
    step = 2.0 ** -16 if path == "fixed_point" else 0.0
    acc = ClipAccumulator(layers, policy, fixed_point_step=step)
    valid = np.ones(rows, bool)
    if path == "measured":
        state, scales = acc.measure(acc.init(sums=False), batch, valid, weights=weights)
        totals = [np.zeros(layer.shape) for layer in layers]
        add_example(totals, [b[0] for b in batch], jax.device_get(scales))
        got = totals
    else:
        state = acc.update(acc.init(), batch, valid, weights=weights)
        got = [np.asarray(s, np.float64) for s in state.sums]
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=step or 1e-6)
    plain = acc.update(acc.init(), batch, valid) if path != "measured" else acc.measure(acc.init(sums=False), batch,
                                                                                        valid)[0]
    assert np.array_equal(np.asarray(state.clip_counts), np.asarray(plain.clip_counts))
    assert np.array_equal(np.asarray(state.example_norm_histogram), np.asarray(plain.example_norm_histogram))
