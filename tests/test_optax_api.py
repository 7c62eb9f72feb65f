"""per_example_global_norm_clip / per_example_layer_norm_clip against the real optax 0.2.8."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_close, global_norms, layer_shapes, random_batch

from clipd import engine

BOUNDS = {"zero": 0.0, "tiny": 1e-6, "typical": None, "huge": 1e6, "inf": float("inf")}


def _bound(name: str, batch: list[np.ndarray]) -> float:
    if BOUNDS[name] is not None:
        return BOUNDS[name]
    return float(np.median(global_norms(batch))) * 1.01


def _check_same(ours, ref, dtype):
    (our_sums, our_count), (ref_sums, ref_count) = ours, ref
    assert jax.tree.structure(our_sums) == jax.tree.structure(ref_sums)
    for a, e in zip(jax.tree.leaves(our_sums), jax.tree.leaves(ref_sums)):
        assert_close(a, e, dtype)
    for a, e in zip(jax.tree.leaves(our_count), jax.tree.leaves(ref_count)):
        assert np.asarray(a).dtype == np.asarray(e).dtype
        assert int(a) == int(e)


CASES = list(itertools.product([1, 4, 17], [1, 64], ["float32", "float16", "bfloat16"], BOUNDS))


@pytest.mark.parametrize("num_layers,batch,dtype,bound", CASES)
def test_global_clip_matches_optax(num_layers, batch, dtype, bound):
    rng = np.random.default_rng(hash((num_layers, batch, dtype, bound)) % 2**32)
    grads = [jnp.asarray(x) for x in random_batch(rng, batch, layer_shapes(num_layers, rng), dtype)]
    c = _bound(bound, grads)
    _check_same(
        engine.per_example_global_norm_clip(grads, c), optax.per_example_global_norm_clip(grads, c), dtype
    )


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("num_layers,batch,dtype,bound", CASES[::2])
def test_layer_clip_matches_optax(num_layers, batch, dtype, bound, uniform):
    rng = np.random.default_rng(hash((num_layers, batch, dtype, bound, uniform)) % 2**32)
    grads = [jnp.asarray(x) for x in random_batch(rng, batch, layer_shapes(num_layers, rng), dtype)]
    c = _bound(bound, grads)
    ours = engine.per_example_layer_norm_clip(grads, c, uniform=uniform)
    ref = optax.per_example_layer_norm_clip(grads, c, uniform=uniform)
    _check_same(ours, ref, dtype)


@pytest.mark.parametrize("fn", ["per_example_global_norm_clip", "per_example_layer_norm_clip"])
def test_float64_under_x64_matches_optax(fn):
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        grads = {"a": jnp.asarray(rng.standard_normal((8, 3, 2))), "b": jnp.asarray(rng.standard_normal((8, 4)))}
        c = float(np.median(global_norms(list(grads.values()))))
        ours, ref = getattr(engine, fn)(grads, c), getattr(optax, fn)(grads, c)
        assert jax.tree.leaves(ours[0])[0].dtype == jnp.float64
        assert jax.tree.leaves(ours[1])[0].dtype == jnp.int64
        _check_same(ours, ref, "float64")


SEED_GRADS = [[0, 0, 0], [0, 3, 4], [4, 0, 3], [3, 4, 0]]


@pytest.mark.parametrize(
    "bound,expected_sum,expected_count",
    [(float("inf"), 7.0, 0), (0.0, 0.0, 3), (1.25, 1.75, 3), (5.0, 7.0, 0), (4.999, None, 3)],
)
def test_seed_worked_examples_and_ties(bound, expected_sum, expected_count):
    # Seed 000: rows of norm 0, 5, 5, 5. A tie (C = 5) is neither scaled nor counted.
    grads = [jnp.array(SEED_GRADS)]
    (total,), count = engine.per_example_global_norm_clip(grads, bound)
    assert int(count) == expected_count
    if expected_sum is not None:
        np.testing.assert_array_equal(np.asarray(total), np.full(3, expected_sum, np.float32))


EDGE_INPUTS = {
    "nan_entry": [[np.nan, 1.0], [3.0, 4.0]],
    "inf_entry": [[np.inf, 1.0], [3.0, 4.0]],
    "zero_rows": [[0.0, 0.0], [0.0, 0.0]],
    "mixed": [[0.0, 0.0], [3.0, 4.0]],
}


@pytest.mark.parametrize("bound", [0.0, 1.0, float("inf"), float("nan"), -2.0])
@pytest.mark.parametrize("name", list(EDGE_INPUTS))
@pytest.mark.parametrize("fn", ["per_example_global_norm_clip", "per_example_layer_norm_clip"])
def test_edge_cases_match_optax(fn, name, bound):
    grads = [jnp.asarray(EDGE_INPUTS[name], jnp.float32), jnp.ones((2, 3), jnp.float32)]
    ours, ref = getattr(engine, fn)(grads, bound), getattr(optax, fn)(grads, bound)
    _check_same(ours, ref, "float32")


def test_dict_tree_mixed_dtypes_and_rank1_leaf():
    rng = np.random.default_rng(1)
    grads = {
        "w": jnp.asarray(rng.standard_normal((6, 4)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal((6,)), jnp.bfloat16),  # a (B,) leaf sums to 0-d
        "i": jnp.asarray(rng.integers(-3, 3, (6, 2)), jnp.int32),
    }
    for fn in ("per_example_global_norm_clip", "per_example_layer_norm_clip"):
        ours, ref = getattr(engine, fn)(grads, 1.5), getattr(optax, fn)(grads, 1.5)
        _check_same(ours, ref, "bfloat16")
    # The global clip promotes the bf16 leaf's sum to float32, as optax does.
    assert engine.per_example_global_norm_clip(grads, 1.5)[0]["b"].dtype == jnp.float32


def test_per_example_bound_array_broadcasts():
    grads = [jnp.array(SEED_GRADS, jnp.float32)]
    bounds = jnp.array([1.0, 5.0, 2.5, 10.0])
    _check_same(
        engine.per_example_global_norm_clip(grads, bounds),
        optax.per_example_global_norm_clip(grads, bounds),
        "float32",
    )


def test_empty_batch_gives_zero_sums():
    grads = [jnp.zeros((0, 3))]
    (total,), count = engine.per_example_global_norm_clip(grads, 1.0)
    np.testing.assert_array_equal(np.asarray(total), np.zeros(3, np.float32))
    assert int(count) == 0


@pytest.mark.parametrize(
    "grads,error",
    [
        ([], IndexError),
        ([jnp.ones((3, 2)), jnp.ones((4, 2))], ValueError),
        ([jnp.ones((3, 2)), jnp.float32(1.0)], ValueError),
    ],
)
@pytest.mark.parametrize("fn", ["per_example_global_norm_clip", "per_example_layer_norm_clip"])
def test_errors_match_optax(fn, grads, error):
    with pytest.raises(error):
        getattr(optax, fn)(grads, 1.0)
    with pytest.raises(error):
        getattr(engine, fn)(grads, 1.0)


def test_jit_equals_eager():
    rng = np.random.default_rng(2)
    grads = [jnp.asarray(x) for x in random_batch(rng, 16, [(3, 4), (5,)])]
    for fn in (engine.per_example_global_norm_clip, engine.per_example_layer_norm_clip):
        eager, jitted = fn(grads, 2.0), jax.jit(fn)(grads, 2.0)
        _check_same(jitted, eager, "float32")
