"""NormClipper, ConstantFlatClipper, ConstantPerLayerClipper against hand-worked opacus 0.15 values.

opacus 0.15 is not installable (the registry has only 1.6.0, without these
classes), so the expected factors are worked out here with numpy, following
the torch arithmetic: ``C / (n + 1e-6)`` on a tensor is
``(n + 1e-6).reciprocal() * C``, then ``clamp(max=1.0)``.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from clipd.engine._opacus import ConstantFlatClipper, ConstantPerLayerClipper, NormClipper

F32 = np.float32
BF16 = ml_dtypes.bfloat16


def torch_factor_f32(c: float, norms) -> np.ndarray:
    """min((1 / (n + f32(1e-6))) * f32(C), 1), every step rounded to float32, NaN kept."""
    n = np.asarray(norms, F32)
    factor = (F32(1) / (n + F32(1e-6))) * F32(c)
    return np.where(factor > 1, F32(1), factor)


def assert_same(actual, expected) -> None:
    actual = np.asarray(actual)
    assert actual.dtype == np.asarray(expected).dtype, (actual.dtype, np.asarray(expected).dtype)
    np.testing.assert_array_equal(actual, expected)  # exact, NaN == NaN


def flat(c, norms):
    return next(ConstantFlatClipper(c).calc_clipping_factors([jnp.asarray(norms, jnp.float32)]))


def test_tie_is_scaled_by_the_epsilon():
    # f32(1 + 1e-6) = 1 + 8 * 2**-23 = 1.00000095367; 1 / that = 0.99999904633 -> f32 0.99999905.
    assert_same(flat(1.0, [1.0]), np.array([0.99999905], F32))
    # A norm just below C is scaled too: 1 / (0.9999999 + 1e-6) * 1 < 1.
    assert flat(1.0, [0.9999999])[0] < 1


def test_factor_is_reciprocal_times_bound_not_a_division():
    # n = f32(3.33): 1 / (n + 1e-6) * 3 = 0.9009006023 in float32, while 3 / (n + 1e-6)
    # rounds to 0.9009006619: torch's float / Tensor is Tensor.reciprocal() * float.
    n = F32(3.33)
    assert F32(3) / (n + F32(1e-6)) != F32(0.9009006023406982)
    assert_same(flat(3.0, [n]), np.array([0.9009006023406982], F32))


@pytest.mark.parametrize(
    "c,norm,expected",
    [
        (1.0, 0.0, 1.0),  # 1 / 1e-6 = 1e6, clamped to 1
        (0.0, 0.0, 0.0),  # (1 / 1e-6) * 0 = 0, not NaN
        (0.0, 5.0, 0.0),
        (math.inf, 1e30, 1.0),  # inf, clamped to 1
        (math.inf, math.inf, math.nan),  # (1 / inf) * inf = 0 * inf
        (1.0, math.inf, 0.0),
        (1.0, math.nan, math.nan),  # the clamp keeps NaN
        (math.nan, 1.0, math.nan),
        (-1.0, 0.0, -1e6),  # 1 / f32(1e-6) = 1e6 exactly in float32; not clamped below
        (-1.0, 1.0, -0.99999905),
        (1.0, 32.0, 0.03125),  # f32(32 + 1e-6) == 32: the epsilon rounds away
        (2.0, 4.0, 0.49999988),  # f32(4 + 1e-6) = 4.00000095, 1 / that = 0.24999994, * 2
    ],
)
def test_edge_values(c, norm, expected):
    assert_same(flat(c, [norm]), np.array([expected], F32))


def test_random_norms_and_bounds_match_the_formula():
    rng = np.random.default_rng(0)
    norms = (rng.random(2000) * 10.0 ** rng.integers(-7, 4, 2000)).astype(F32)
    for c in [1e-6, 0.1, 0.3, 1.0, 3.0, 7.77, 1e3]:
        assert_same(flat(c, norms), torch_factor_f32(c, norms))
        per_layer = ConstantPerLayerClipper([c]).calc_clipping_factors([norms])
        assert_same(per_layer[0], torch_factor_f32(c, norms))


def test_float64_under_x64():
    with jax.enable_x64(True):
        norms = jnp.array([1.0, 3.33, 0.5], jnp.float64)
        factor = next(ConstantFlatClipper(3.0).calc_clipping_factors([norms]))
        per_layer = ConstantPerLayerClipper([3.0]).calc_clipping_factors([norms])[0]
        thresholds = ConstantFlatClipper(3.0).thresholds
    n = np.array([1.0, 3.33, 0.5])
    expected = np.minimum((1.0 / (n + 1e-6)) * 3.0, 1.0)  # float64 throughout
    assert_same(factor, expected)
    assert_same(per_layer, expected)
    assert thresholds.dtype == jnp.float32


def test_bfloat16_multiplies_by_a_float32_bound():
    # torch adds bf16(1e-6) and takes the reciprocal in bfloat16, then multiplies by C in
    # float32 (its opmath) and rounds once. For n = 0.44921875, C = 0.3: 1 / n -> bf16 2.21875,
    # * 0.3 = 0.665625 -> bf16 0.6640625 (C rounded to bf16 0.30078125 would give 0.66796875).
    norms = jnp.array([0.44921875, 0.6015625, 1.0, 0.0], jnp.bfloat16)
    n = np.asarray(norms)
    inverse = (F32(1) / (n.astype(F32) + F32(BF16(1e-6))).astype(BF16).astype(F32)).astype(BF16)
    expected = np.minimum((inverse.astype(F32) * F32(0.3)).astype(BF16), BF16(1))
    assert_same(expected[:2], np.array([0.6640625, 0.5], BF16))
    assert_same(next(ConstantFlatClipper(0.3).calc_clipping_factors([norms])), expected)


def test_float16_keeps_its_dtype():
    # f16(1 + f16(1e-6)) == 1 and 1 * 0.5 = 0.5; f16(4 + 1e-6) == 4: 0.25 * 0.5.
    norms = jnp.array([1.0, 4.0], jnp.float16)
    factor = next(ConstantFlatClipper(0.5).calc_clipping_factors([norms]))
    assert_same(factor, np.array([0.5, 0.125], np.float16))


def test_flat_clipper_returns_an_endless_cycle_of_one_factor():
    clipper = ConstantFlatClipper(1)
    assert clipper.flat_value == 1.0 and type(clipper.flat_value) is float
    factors = clipper.calc_clipping_factors([jnp.array([0.5, 2.0])])
    assert isinstance(factors, itertools.cycle)
    first, *rest = itertools.islice(factors, 5)
    assert all(f is first for f in rest)
    assert clipper.is_per_layer is False
    assert_same(clipper.thresholds, np.array([1.0], F32))


@pytest.mark.parametrize("num_layers", [0, 2, 3])
def test_flat_clipper_rejects_other_than_one_norm(num_layers):
    message = f"^Waring: flat norm selected but received norm for {num_layers} layers$"
    with pytest.raises(ValueError, match=message):
        ConstantFlatClipper(1.0).calc_clipping_factors([jnp.ones(2)] * num_layers)


def mismatch(layers: int, thresholds: int) -> str:
    """opacus's message, as a regex."""
    return (
        f"^{layers} layers have provided norms but the "
        f"number of clipping thresholds is {thresholds}$"
    )


def test_per_layer_clipper_uses_each_layer_bound():
    clipper = ConstantPerLayerClipper([1, 2.0, 0.0])
    assert clipper.flat_values == [1.0, 2.0, 0.0]
    assert all(type(v) is float for v in clipper.flat_values)
    norms = [jnp.array([3.0, 0.5]), jnp.array([4.0]), jnp.array([1.0, 0.0])]
    factors = clipper.calc_clipping_factors(norms)
    assert type(factors) is list and len(factors) == 3
    for factor, c, n in zip(factors, [1.0, 2.0, 0.0], norms):
        assert_same(factor, torch_factor_f32(c, n))
    assert_same(factors[1], np.array([0.49999988], F32))  # as in test_edge_values
    assert clipper.is_per_layer is True
    assert_same(clipper.thresholds, np.array([1.0, 2.0, 0.0], F32))


def test_per_layer_single_bound_is_broadcast_and_stored():
    clipper = ConstantPerLayerClipper([0.5])
    norms = [jnp.array([1.0]), jnp.array([0.25]), jnp.array([2.0])]
    factors = clipper.calc_clipping_factors(norms)
    for factor, n in zip(factors, norms):
        assert_same(factor, torch_factor_f32(0.5, n))
    assert clipper.flat_values == [0.5, 0.5, 0.5]
    assert_same(clipper.thresholds, np.array([0.5, 0.5, 0.5], F32))
    clipper.calc_clipping_factors([jnp.ones(1)] * 3)  # same layer count: fine
    with pytest.raises(ValueError, match=mismatch(2, 3)):
        clipper.calc_clipping_factors([jnp.ones(1)] * 2)


def test_per_layer_single_bound_with_no_layers_stores_an_empty_list():
    clipper = ConstantPerLayerClipper([1.0])
    assert clipper.calc_clipping_factors([]) == []
    assert clipper.flat_values == [] and clipper.thresholds.shape == (0,)
    with pytest.raises(ValueError, match=mismatch(1, 0)):
        clipper.calc_clipping_factors([jnp.ones(1)])


def test_per_layer_mismatch_raises_without_changing_state():
    clipper = ConstantPerLayerClipper([1.0, 2.0])
    with pytest.raises(ValueError, match=mismatch(3, 2)):
        clipper.calc_clipping_factors([jnp.ones(1)] * 3)
    assert clipper.flat_values == [1.0, 2.0]


def test_norm_clipper_base_is_instantiable_and_returns_none():
    clipper = NormClipper()
    assert clipper.calc_clipping_factors([jnp.ones(1)]) is None
    assert clipper.thresholds is None and clipper.is_per_layer is None
    assert isinstance(ConstantFlatClipper(1.0), NormClipper)
    assert isinstance(ConstantPerLayerClipper([1.0]), NormClipper)
