"""clip_pytree against the real jax_privacy 2.0.0, row by row of its edge-case table."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
from jax_privacy import clipping as jp

from clipd import engine


def _structures(dtype: str) -> dict[str, object]:
    rng = np.random.default_rng(0)
    arr = lambda *s: jnp.asarray(rng.standard_normal(s) * 3, dtype)  # noqa: E731
    return {
        "bare": arr(5),
        "list": [arr(3), arr(2, 2)],
        "dict": {"w": arr(2, 3), "b": arr(3), "nested": {"z": arr(1)}},
        "zero": [jnp.zeros((4,), dtype)],
    }


def _check_same(ours, ref, dtype="float32"):
    (out, norm), (ref_out, ref_norm) = ours, ref
    assert jax.tree.structure(out) == jax.tree.structure(ref_out)
    for a, e in zip(jax.tree.leaves(out), jax.tree.leaves(ref_out)):
        assert_close(a, e, dtype)
    assert_close(norm, ref_norm, "float32" if dtype != "bfloat16" else dtype)


BOUNDS = [0.0, 1.0, 2.0, float("inf"), float("nan")]
FLAGS = list(itertools.product([False, True], repeat=3))  # rescale, nan_safe, return_zero


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.parametrize("rescale,nan_safe,return_zero", FLAGS)
def test_matches_jax_privacy(dtype, bound, rescale, nan_safe, return_zero):
    for tree in _structures(dtype).values():
        kwargs = dict(rescale_to_unit_norm=rescale, nan_safe=nan_safe, return_zero=return_zero)
        _check_same(engine.clip_pytree(tree, bound, **kwargs), jp.clip_pytree(tree, bound, **kwargs), dtype)


@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize("nan_safe", [False, True])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_match_jax_privacy(bad, nan_safe, rescale):
    tree = {"a": jnp.array([3.0, bad, 4.0]), "b": jnp.array([[1.0, 2.0]])}
    kwargs = dict(rescale_to_unit_norm=rescale, nan_safe=nan_safe)
    _check_same(engine.clip_pytree(tree, 1.0, **kwargs), jp.clip_pytree(tree, 1.0, **kwargs))


@pytest.mark.parametrize("bound", [-1.0, -1, np.float32(-0.5), np.int64(-3)])
def test_static_negative_bound_raises(bound):
    with pytest.raises(ValueError):
        jp.clip_pytree([jnp.ones(2)], bound)
    with pytest.raises(ValueError, match="non-negative"):
        engine.clip_pytree([jnp.ones(2)], bound)


@pytest.mark.parametrize("rescale", [False, True])
def test_dynamic_negative_bound_clamps(rescale):
    # The seed's table says "Zero" for both; with rescaling the library gives x / ||x||.
    tree = [jnp.array([3.0, 4.0])]
    ours = engine.clip_pytree(tree, jnp.array(-1.0), rescale_to_unit_norm=rescale)
    _check_same(ours, jp.clip_pytree(tree, jnp.array(-1.0), rescale_to_unit_norm=rescale))
    expected = [0.6, 0.8] if rescale else [0.0, 0.0]
    np.testing.assert_allclose(ours[0][0], expected, rtol=1e-6)


def test_seed_edge_table_rows():
    x = [jnp.array([3.0, 4.0])]  # norm 5
    out = lambda c, r=False: np.asarray(engine.clip_pytree(x, c, rescale_to_unit_norm=r)[0][0])  # noqa: E731
    np.testing.assert_array_equal(out(0.0), [0, 0])  # C = 0: zero
    np.testing.assert_allclose(out(0.0, True), [0.6, 0.8], rtol=1e-6)  # C = 0, rescale: x/||x||
    np.testing.assert_array_equal(out(math.inf), [3, 4])  # C = inf: unchanged
    np.testing.assert_array_equal(out(math.inf, True), [0, 0])  # C = inf, rescale: zero
    np.testing.assert_array_equal(out(5.0), [3, 4])  # tie: unchanged
    np.testing.assert_allclose(out(5.0, True), [0.6, 0.8], rtol=1e-6)  # tie, rescale: x / C
    zeros = [jnp.zeros(2)]
    np.testing.assert_array_equal(engine.clip_pytree(zeros, 1.0)[0][0], [0, 0])  # norm 0: unchanged


@pytest.mark.parametrize("tree", [{}, [], [jnp.zeros((0, 3))]])
def test_empty_trees(tree):
    _check_same(engine.clip_pytree(tree, 1.0), jp.clip_pytree(tree, 1.0))


def test_int_leaf_gets_int_scale():
    tree = {"i": jnp.array([3, 4], jnp.int32), "f": jnp.array([0.0], jnp.float32)}
    for c in (1.0, 10.0):
        _check_same(engine.clip_pytree(tree, c), jp.clip_pytree(tree, c))
    assert engine.clip_pytree(tree, 1.0)[0]["i"].dtype == jnp.int32


def test_return_zero_as_traced_array_keeps_norm():
    tree = [jnp.array([3.0, 4.0])]
    out, norm = jax.jit(engine.clip_pytree, static_argnums=1)(tree, 1.0, return_zero=jnp.array(True))
    np.testing.assert_array_equal(out[0], [0.0, 0.0])
    assert float(norm) == 5.0


def test_float64_under_x64_norm_is_float32():
    with jax.enable_x64(True):
        tree = [jnp.array([3.0, 4.0], jnp.float64)]
        ours, ref = engine.clip_pytree(tree, 1.0), jp.clip_pytree(tree, 1.0)
        assert ours[0][0].dtype == jnp.float64 and ours[1].dtype == jnp.float32
        _check_same(ours, ref, "float64")


# Properties: the formal guarantees, idempotence, jit == eager.
finite_vectors = st.lists(
    st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=6
).map(lambda v: jnp.asarray(v, jnp.float32))
bounds = st.sampled_from([0.0, 1e-3, 0.5, 1.0, 3.0, 1e4, math.inf])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(x=finite_vectors, y=finite_vectors, c=bounds, rescale=st.booleans())
def test_output_norm_within_bound(x, y, c, rescale):
    out, norm = engine.clip_pytree({"x": x, "y": y}, c, rescale_to_unit_norm=rescale)
    out_norm = float(engine._tree.tree_l2_norm(out))
    limit = 1.0 if rescale else c
    assert out_norm <= limit * (1 + 1e-5) + 1e-30


@settings(max_examples=40, deadline=None, derandomize=True)
@given(x=finite_vectors, c=bounds)
def test_clipping_twice_equals_once(x, c):
    once, _ = engine.clip_pytree([x], c)
    twice, _ = engine.clip_pytree(once, c)
    np.testing.assert_allclose(twice[0], once[0], rtol=1e-5, atol=1e-30)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(x=finite_vectors, c=bounds, rescale=st.booleans())
def test_jit_equals_eager(x, c, rescale):
    eager = engine.clip_pytree([x], c, rescale_to_unit_norm=rescale)
    jitted = jax.jit(lambda t, c: engine.clip_pytree(t, c, rescale_to_unit_norm=rescale))([x], jnp.float32(c))
    _check_same(jitted, eager)
