"""L2Clipping / L2GlobalClipping: hand-worked values, and the real declearn 2.9.1 as an oracle."""

from __future__ import annotations

import itertools
import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from clipd.engine._declearn import L2Clipping, L2GlobalClipping

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's 0/0, inf*0, as declearn

MODULES = [L2Clipping, L2GlobalClipping]
BF16 = ml_dtypes.bfloat16


def assert_identical(actual: dict, expected: dict, context: str = "") -> None:
    """Same keys in the same order; per value the same type, dtype, shape, bits (NaN == NaN)."""
    assert type(actual) is dict and list(actual) == list(expected), context
    for key in expected:
        a, e, where = actual[key], expected[key], f"{context} [{key!r}]"
        assert type(a) is type(e), (where, type(a), type(e))
        assert a.dtype == e.dtype and np.shape(a) == np.shape(e), (where, a.dtype, e.dtype)
        a64, e64 = np.asarray(a, np.float64), np.asarray(e, np.float64)
        np.testing.assert_array_equal(a64, e64, err_msg=where)  # treats NaN == NaN
        signed = ~np.isnan(e64)  # the sign of a NaN is not part of the semantics
        np.testing.assert_array_equal(np.signbit(a64[signed]), np.signbit(e64[signed]), where)


# ---------------------------------------------------------------------------
# Hand-worked values (no oracle needed).


def test_names_config_and_default():
    assert L2Clipping.name == "l2-clipping"
    assert L2GlobalClipping.name == "l2-global-clipping"
    for cls in MODULES:
        assert cls().max_norm == 1.0
        assert cls(2.5).get_config() == {"max_norm": 2.5}


def test_global_scales_every_coefficient_by_the_same_factor():
    # ||g|| = sqrt(3^2 + 4^2) = 5 > C = 2.5, scale (5 / 2.5) ** -1 = 0.5.
    out = L2GlobalClipping(2.5).run({"w": np.array([3.0]), "b": np.array([[4.0]])})
    assert_identical(out, {"w": np.array([1.5]), "b": np.array([[2.0]])})


def test_per_parameter_scales_each_coefficient_by_its_own_factor():
    # w: ||w|| = 5, scale (5 / 1) ** -1 = 0.2 -> [3 * 0.2, 4 * 0.2]; b: ||b|| = 0.5 <= 1, unchanged.
    out = L2Clipping(1.0).run({"w": np.array([3.0, 4.0]), "b": np.array([0.5])})
    assert_identical(out, {"w": np.array([3.0 * 0.2, 4.0 * 0.2]), "b": np.array([0.5])})


@pytest.mark.parametrize("cls", MODULES)
def test_tie_is_left_unchanged(cls):
    g = {"w": np.array([3.0, 4.0], np.float32)}  # norm exactly 5
    assert_identical(cls(5.0).run(g), g)


@pytest.mark.parametrize("cls", MODULES)
def test_scale_is_inverted_quotient_not_division(cls):
    # norm = sqrt(2); declearn computes (sqrt(2) / 0.7) ** -1 = 0.49497474683058323,
    # one ulp away from 0.7 / sqrt(2) = 0.4949747468305832.
    expected = 0.49497474683058323
    assert expected != 0.7 / math.sqrt(2.0)
    out = cls(0.7).run({"w": np.array([1.0, 1.0])})
    assert_identical(out, {"w": np.array([expected, expected])})


@pytest.mark.parametrize("cls", MODULES)
def test_zero_vector_with_zero_bound_is_nan(cls):
    # (0 / 0) ** -1 = NaN; optax would give 1 and jax_privacy 0 here.
    out = cls(0.0).run({"w": np.zeros(3, np.float32)})
    assert_identical(out, {"w": np.full(3, np.nan, np.float32)})


@pytest.mark.parametrize("cls", MODULES)
def test_zero_bound_zeroes_a_nonzero_vector(cls):
    # (norm / 0) ** -1 = inf ** -1 = 0; signs kept: -3 * 0 = -0.0.
    out = cls(0.0).run({"w": np.array([-3.0, 4.0])})
    assert_identical(out, {"w": np.array([-0.0, 0.0])})


@pytest.mark.parametrize("cls", MODULES)
def test_infinite_bound_never_clips(cls):
    g = {"w": np.array([3e30, -4e30])}
    assert_identical(cls(math.inf).run(g), g)


@pytest.mark.parametrize("cls", MODULES)
def test_negative_bound_flips_the_sign(cls):
    # (5 / -1) ** -1 = -0.2, min(-0.2, 1) = -0.2.
    out = cls(-1.0).run({"w": np.array([3.0, 4.0])})
    assert_identical(out, {"w": np.array([3.0 * -0.2, 4.0 * -0.2])})


@pytest.mark.parametrize("cls", MODULES)
def test_nan_bound_gives_nan(cls):
    out = cls(math.nan).run({"w": np.array([3.0, 4.0])})
    assert_identical(out, {"w": np.array([np.nan, np.nan])})


def test_nan_entry_global_makes_everything_nan_per_parameter_only_its_coefficient():
    g = {"w": np.array([np.nan, 1.0]), "b": np.array([3.0, 4.0])}
    nan = np.full(2, np.nan)
    assert_identical(L2GlobalClipping(1.0).run(g), {"w": nan, "b": nan})
    assert_identical(L2Clipping(1.0).run(g), {"w": nan, "b": np.array([3.0, 4.0]) * 0.2})


def test_inf_entry_gives_nan_there_and_zero_elsewhere():
    # norm = inf, scale (inf / 1) ** -1 = 0: inf * 0 = NaN, finite * 0 = 0.
    g = {"w": np.array([np.inf, 1.0]), "b": np.array([3.0, 4.0])}
    assert_identical(L2GlobalClipping(1.0).run(g), {"w": np.array([np.nan, 0.0]), "b": np.zeros(2)})


def test_global_sums_coefficients_in_insertion_order():
    # float32 sums of squares: z -> 1, a, b, c, d -> 2**-24 each. In insertion order each
    # 2**-24 is absorbed by 1 (ties to even): total 1, norm 1, scale (1 / 0.5) ** -1 = 0.5.
    # Sorted order (a, b, c, d, z) would give 1 + 2**-22 and a scale below 0.5.
    tiny = np.array([2.0**-12], np.float32)
    g = {"z": np.array([1.0], np.float32), **{k: tiny for k in "abcd"}}
    out = L2GlobalClipping(0.5).run(g)
    half = np.array([2.0**-13], np.float32)
    assert_identical(out, {"z": np.array([0.5], np.float32), **{k: half for k in "abcd"}})


def test_dtypes(declearn):
    g = {
        "bf16": np.ones(2, BF16),
        "i64": np.array([3, 4], np.int64),
        "f32": np.ones(2, np.float32),
        "f64": np.ones(2, np.float64),
        "scalar": np.array(np.float32(0.5)),
    }
    local = L2Clipping(10.0).run(g)
    # bfloat16's: what numpy's ufuncs give it, which ml_dtypes decides (float32 before 0.7, bfloat16 from it):
    # the real declearn's, under the same numpy and ml_dtypes
    bf16 = declearn(L2Clipping, 10.0, {"bf16": g["bf16"]})["bf16"].dtype.name
    assert bf16 in ("float32", "bfloat16")
    assert {k: v.dtype.name for k, v in local.items()} == {
        "bf16": bf16, "i64": "float64", "f32": "float32", "f64": "float64", "scalar": "float32"
    }
    assert type(local["scalar"]) is np.float32  # a 0-d coefficient comes back a numpy scalar
    half = L2GlobalClipping(10.0).run({"a": np.ones(2, np.float16), "b": np.ones(3, np.float16)})
    assert all(v.dtype == np.float16 for v in half.values())  # float16 kept when all are float16
    glob = L2GlobalClipping(10.0).run(g)  # the float64 total upcasts every coefficient
    assert all(v.dtype == np.float64 for v in glob.values())
    assert type(glob["scalar"]) is np.float64


@pytest.mark.parametrize("cls", MODULES)
@pytest.mark.parametrize("max_norm", [np.float64(2.0), np.float16(2.0), 2])
def test_numpy_or_int_bound_does_not_change_the_dtype(cls, max_norm):
    out = cls(max_norm).run({"w": np.array([3.0, 4.0], np.float32)})
    assert_identical(out, {"w": np.array([1.2, 1.6], np.float32)})


def test_empty_input():
    g: dict = {}
    assert L2GlobalClipping(1.0).run(g) is g
    out = L2Clipping(1.0).run(g)
    assert out == {} and out is not g
    assert L2Clipping(1.0).run([]) == []


@pytest.mark.parametrize("cls", MODULES)
def test_jax_arrays_and_nested_pytrees(cls):
    g = {"layer": {"w": jnp.array([3.0, 4.0]), "b": jnp.array([0.0])}, "out": [jnp.array([12.0])]}
    out = cls(1.0).run(g)
    assert list(out) == ["layer", "out"] and list(out["layer"]) == ["b", "w"]  # jax.tree order
    assert type(out["out"]) is list and len(out["out"]) == 1
    assert all(type(x) is np.ndarray for x in (out["layer"]["w"], out["layer"]["b"], out["out"][0]))
    if cls is L2GlobalClipping:  # ||g|| = 13
        np.testing.assert_allclose(out["out"][0], [12 / 13], rtol=1e-6)
        np.testing.assert_allclose(out["layer"]["w"], [3 / 13, 4 / 13], rtol=1e-6)
    else:
        np.testing.assert_allclose(out["out"][0], [1.0], rtol=1e-6)
        np.testing.assert_allclose(out["layer"]["w"], [0.6, 0.8], rtol=1e-6)


# ---------------------------------------------------------------------------
# The real declearn 2.9.1 as an oracle: same types, dtypes and bits.


@pytest.fixture(scope="module")
def declearn():
    modules = pytest.importorskip("declearn.optimizer.modules")
    vector = pytest.importorskip("declearn.model.sklearn").NumpyVector
    oracle = {L2Clipping: modules.L2Clipping, L2GlobalClipping: modules.L2GlobalClipping}

    def run(cls, max_norm, coefs):
        return oracle[cls](max_norm).run(vector(coefs)).coefs

    return run


DTYPES = [np.float16, np.float32, np.float64, BF16, np.int64]
BOUNDS = [0.0, 1e-3, 1.0, 3.0, math.inf, -1.0, math.nan, np.float32(0.3), np.float64(2.0)]


@pytest.mark.parametrize("cls", MODULES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_matches_declearn_on_random_inputs(declearn, cls, dtype):
    rng = np.random.default_rng(DTYPES.index(dtype))
    for other, max_norm in itertools.product(DTYPES, BOUNDS):
        g = {
            "w": (rng.standard_normal((3, 4)) * 2).astype(dtype),
            "b": rng.standard_normal(5).astype(other),
            "a": np.array(rng.standard_normal()).astype(dtype),
        }
        assert_identical(cls(max_norm).run(g), declearn(cls, max_norm, g), f"{other=} {max_norm=}")


EDGE_CASES = {
    "zeros": {"w": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)},
    "one zero coefficient": {"w": np.zeros(3), "b": np.array([3.0, 4.0])},
    "nan": {"w": np.array([np.nan, 1.0]), "b": np.ones(2)},
    "inf": {"w": np.array([np.inf, 1.0]), "b": np.ones(2)},
    "tie": {"w": np.array([0.6, 0.8], np.float32)},
    "mixed f32 f64": {"w": np.ones(3, np.float32), "b": np.full(2, 2.0)},
    "bf16": {"w": np.array([3.0, 4.0], BF16)},
    "int64": {"w": np.array([3, 4], np.int64)},
    "0-d": {"s": np.array(np.float32(7.0)), "w": np.ones(2, np.float32)},
    "unsorted keys": {
        "z": np.array([1.0], np.float32),
        **{k: np.array([2.0**-12], np.float32) for k in "abcd"},
    },
}


@pytest.mark.parametrize("cls", MODULES)
@pytest.mark.parametrize("case", EDGE_CASES)
def test_matches_declearn_on_edge_cases(declearn, cls, case):
    g = EDGE_CASES[case]
    for max_norm in [0.0, 0.5, 1.0, math.inf, -2.0, math.nan]:
        assert_identical(cls(max_norm).run(g), declearn(cls, max_norm, g), f"{max_norm=}")


@pytest.mark.parametrize("cls", MODULES)
def test_matches_declearn_on_jax_arrays(declearn, cls):
    g = {"w": jnp.array([[3.0, 4.0]], jnp.bfloat16), "b": jnp.arange(3.0)}
    assert_identical(cls(1.0).run(g), declearn(cls, 1.0, {k: np.asarray(v) for k, v in g.items()}))


def test_empty_matches_declearn(declearn):
    g: dict = {}
    assert declearn(L2GlobalClipping, 1.0, g) is g  # so returning g itself is declearn's behaviour
    assert declearn(L2Clipping, 1.0, g) == {}
