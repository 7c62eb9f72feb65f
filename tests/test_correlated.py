"""Correlated noise (clipd.engine._correlated) against jax_privacy 2.0's matrix factorization: a BLT's
coefficients, its inverse, its streaming noise, its min-separation sensitivity, and the noise stream's
covariance across releases (with independent noise as the negative control)."""

from __future__ import annotations

import doctest
import itertools

import jax
import numpy as np
import pytest
from jax_privacy.matrix_factorization import buffered_toeplitz, sensitivity, toeplitz

from clipd.engine import _correlated
from clipd.engine._correlated import (
    BandedToeplitz,
    Blt,
    banded_noise_step,
    blt_noise_step,
    participations,
    toeplitz_min_sep_sensitivity,
)

# A hand-picked BLT, and the one jax_privacy's optimizer returns for n=8, b=2, k=4 with 2 buffers.
STRATEGIES = [
    Blt(theta=(0.9, 0.5), omega=(0.2, 0.1)),
    Blt(theta=(0.9999999196461978, 0.3687276890822278), omega=(0.1091019753008654, 0.3284986898343375)),
    Blt(theta=(0.98886, 0.772988), omega=(0.146028, 0.323541)),
    Blt(theta=(0.7,), omega=(0.4,)),
]


def _oracle(blt: Blt):
    return buffered_toeplitz.BufferedToeplitz.build(buf_decay=list(blt.theta), output_scale=list(blt.omega))


def test_the_module_doctests():
    assert doctest.testmod(_correlated).failed == 0


@pytest.mark.parametrize("blt", STRATEGIES)
def test_coefficients_and_inverse_equal_jax_privacys(blt):
    with jax.enable_x64():
        oracle = _oracle(blt)
        coefs = np.asarray(oracle.toeplitz_coefs(40))
        inverse = np.asarray(oracle.inverse().toeplitz_coefs(40))
        matrix = np.asarray(oracle.materialize(12))
    np.testing.assert_allclose(blt.coefs(40), coefs, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(blt.inverse_coefs(40), inverse, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(blt.matrix(12), matrix, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("blt", STRATEGIES)
def test_the_streaming_noise_is_jax_privacys_and_c_inverse_z(blt):
    n, d = 16, 5
    z = np.random.default_rng(7).standard_normal((n, d))
    buffers = np.zeros((blt.buffers, d))
    ours = np.stack([blt_noise_step(z[t], buffers, blt) for t in range(n)])
    with jax.enable_x64():
        stream = _oracle(blt).inverse_as_streaming_matrix()
        state = stream.init_multiply(jax.numpy.asarray(z[0]))
        theirs = []
        for t in range(n):
            row, state = stream.multiply_next(jax.numpy.asarray(z[t]), state)
            theirs.append(np.asarray(row))
    np.testing.assert_allclose(ours, np.stack(theirs), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(ours, np.linalg.solve(blt.matrix(n), z), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("blt", STRATEGIES)
@pytest.mark.parametrize(("n", "b", "k"), [(8, 2, 4), (20, 3, 4), (64, 16, 2)])
def test_min_sep_sensitivity_equals_jax_privacys(blt, n, b, k):
    ours = toeplitz_min_sep_sensitivity(blt.coefs(n), min_sep=b, max_participations=k)
    with jax.enable_x64():
        exact = float(np.sqrt(toeplitz.minsep_sensitivity_squared(
            _oracle(blt).toeplitz_coefs(n), min_sep=b, max_participations=k)))
        bound = sensitivity.get_min_sep_sensitivity_upper_bound(np.asarray(_oracle(blt).materialize(n)), b, k)
    assert ours == pytest.approx(exact, rel=1e-10)
    assert ours <= bound * (1 + 1e-9)  # (jax_privacy's bound for any C: not always tight)


def test_the_worked_example():
    """jax_privacy's numbers for the hand-picked BLT at n=8, b=2, k=4 (and brute force over all patterns)."""
    blt = STRATEGIES[0]
    assert toeplitz_min_sep_sensitivity(blt.coefs(8), 2, 4) == pytest.approx(2.8235371374, abs=1e-10)
    c = blt.matrix(8)
    patterns = [p for p in itertools.product([0, 1], repeat=8)
                if sum(p) <= 4 and all(j - i >= 2 for i, j in itertools.pairwise(np.flatnonzero(p)))]
    assert max(np.linalg.norm(c @ np.asarray(p, float)) for p in patterns) == pytest.approx(2.8235371374, abs=1e-10)
    assert participations(8, 2, 4) == 4 and participations(8, 3, 4) == 3 and participations(10, 1, 2) == 2


def _stream_covariance(noise_of_draw, n: int, draws: int) -> np.ndarray:
    rows = np.stack([noise_of_draw(seed) for seed in range(draws)])  # (draws, n, d)
    flat = rows.transpose(0, 2, 1).reshape(-1, n)  # every coordinate of every draw: one sample of the stream
    return flat.T @ flat / len(flat)


def test_the_noise_streams_covariance_is_sigma_squared_c_inverse_c_inverse_transposed():
    """Many seeded draws of a small model: the empirical covariance across releases matches
    sigma^2 C^{-1} C^{-T} within its sampling error; independent noise of the same stddev fails the check."""
    blt, n, d, sigma, draws = STRATEGIES[0], 8, 64, 2.0, 400
    c_inverse = np.linalg.inv(blt.matrix(n))
    expected = sigma**2 * c_inverse @ c_inverse.T
    samples = draws * d
    # The standard error of an empirical covariance entry of Gaussians: sqrt((S_ij^2 + S_ii S_jj) / samples).
    tolerance = 5 * np.sqrt((expected**2 + np.outer(np.diag(expected), np.diag(expected))) / samples)

    def correlated(seed):
        z = sigma * np.random.default_rng(seed).standard_normal((n, d))
        buffers = np.zeros((blt.buffers, d))
        return np.stack([blt_noise_step(z[t], buffers, blt) for t in range(n)])

    def independent(seed):  # each release's variance as the stream's, no correlation across releases
        return np.random.default_rng(seed).standard_normal((n, d)) * np.sqrt(np.diag(expected))[:, None]

    assert np.all(np.abs(_stream_covariance(correlated, n, draws) - expected) <= tolerance)
    assert not np.all(np.abs(_stream_covariance(independent, n, draws) - expected) <= tolerance)


def test_refusals():
    with pytest.raises(ValueError, match=r"buffer decays must be in \[0, 1\)"):
        Blt(theta=(1.0,), omega=(0.1,))
    with pytest.raises(ValueError, match="as many output scales as buffer decays"):
        Blt(theta=(0.5, 0.2), omega=(0.1,))
    with pytest.raises(ValueError, match="non-negative, non-increasing"):
        toeplitz_min_sep_sensitivity([1.0, 0.5, 0.7], 1, 2)
    with pytest.raises(ValueError, match="non-negative, non-increasing"):
        toeplitz_min_sep_sensitivity(Blt(theta=(0.5,), omega=(-0.3,)).coefs(6), 1, 2)
    with pytest.raises(ValueError, match="BLT buffers of shape"):
        blt_noise_step(np.zeros(3), np.zeros((2, 4)), Blt(theta=(0.5, 0.1), omega=(0.1, 0.1)))


def test_the_optimized_blt_is_jax_privacys_and_beats_independent_noise():
    """n=8, b=2, k=4 with 2 buffers: jax_privacy's optimum (its numbers), whose loss (squared sensitivity
    times the largest prefix-sum error) is below independent noise's (k_eff x n = 32)."""
    blt = _correlated.optimize_blt(8, 2, 4, buffers=2)
    np.testing.assert_allclose(blt.theta, STRATEGIES[1].theta, rtol=1e-6)
    np.testing.assert_allclose(blt.omega, STRATEGIES[1].omega, rtol=1e-5)
    sens = toeplitz_min_sep_sensitivity(blt.coefs(8), 2, 4)
    b = np.tri(8) @ np.linalg.inv(blt.matrix(8))
    loss = sens**2 * np.max(np.sum(b**2, axis=1))
    assert loss == pytest.approx(20.5476, rel=1e-4) and loss < 4 * 8


def test_the_prefix_of_a_stream_is_one_gaussian_mechanism():
    """Epsilon after t of n releases: dp_accounting's for one Gaussian event of multiplier z sens(n)/sens(t);
    the whole stream's is one event of z (not n composed events)."""
    import dp_accounting

    blt, z = STRATEGIES[0], 1.0

    def epsilon(multiplier):
        accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
        accountant.compose(dp_accounting.GaussianDpEvent(multiplier), 1)
        return accountant.get_epsilon(1e-5)

    assert _correlated.prefix_noise_multiplier(z, blt, 8, 8, 2, 4) == pytest.approx(z)
    assert epsilon(z) == pytest.approx(4.377178, abs=1e-5)  # jax_privacy's SingleReleaseTrainingAccountant's
    multipliers = [_correlated.prefix_noise_multiplier(z, blt, 8, t, 2, 4) for t in range(1, 9)]
    assert multipliers == sorted(multipliers, reverse=True)  # epsilon grows with each release, up to epsilon(z)
    assert multipliers[0] == pytest.approx(2.8235371374 / 1.0)  # one release: sensitivity 1 (c_0 = 1)
    with pytest.raises(ValueError, match=r"min_separation must be in \[1, releases=8\]"):
        _correlated.check_stream(8, 9, 1)
    with pytest.raises(ValueError, match="max_participations must be >= 1"):
        _correlated.check_stream(8, 2, 0)
    with pytest.raises(ValueError, match=r"buffers must be in \[1, min\(releases=4, 10\)\]"):
        _correlated.check_stream(4, 2, 2, buffers=5)


BANDED = [BandedToeplitz((0.682983, 0.482802, 0.414458, 0.358695)), BandedToeplitz((1.0, 0.5)),
          BandedToeplitz((1.0,))]


@pytest.mark.parametrize("strategy", BANDED)
def test_the_banded_noise_is_jax_privacys_and_c_inverse_z(strategy):
    n, d = 12, 3
    z = np.random.default_rng(3).standard_normal((n, d))
    history = np.zeros((strategy.buffers, d))
    ours = np.stack([banded_noise_step(z[t], history, strategy) for t in range(n)])
    with jax.enable_x64():
        stream = toeplitz.inverse_as_streaming_matrix(jax.numpy.asarray(strategy.coefs_))
        theirs = np.asarray(stream @ jax.numpy.asarray(z))
    np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(ours, np.linalg.solve(strategy.matrix(n), z), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("strategy", BANDED)
@pytest.mark.parametrize(("n", "b", "k"), [(12, 4, 3), (12, 6, 2), (30, 5, 6)])
def test_banded_sensitivity_equals_jax_privacys(strategy, n, b, k):
    ours = toeplitz_min_sep_sensitivity(strategy.coefs(n), min_sep=b, max_participations=k)
    with jax.enable_x64():
        theirs = float(np.sqrt(toeplitz.minsep_sensitivity_squared(
            jax.numpy.asarray(strategy.coefs_), min_sep=b, max_participations=k, n=n)))
    assert ours == pytest.approx(theirs, rel=1e-10)
    # bands <= b: the k' participations' columns do not overlap: sqrt(k') times a column's norm
    assert ours == pytest.approx(np.sqrt(participations(n, b, k)) * np.linalg.norm(strategy.coefs_), rel=1e-10)


def test_the_optimized_banded_strategy_is_jax_privacys():
    strategy = _correlated.optimize_banded(100, 4, min_sep=4, max_participations=25)
    np.testing.assert_allclose(strategy.coefs_, BANDED[0].coefs_, rtol=1e-4)
    with pytest.raises(ValueError, match=r"bands must be in \[1, min_separation=2\]"):
        _correlated.optimize_banded(100, 4, min_sep=2, max_participations=25)


@pytest.mark.parametrize("strategy", [*BANDED, *STRATEGIES])
def test_a_releases_noise_scale_is_the_norm_of_its_row_of_jax_privacys_c_inverse(strategy):
    """Release t's noise stddev is sigma * ||row t of C^-1||: against C materialized by jax_privacy and inverted
    here, and C^-1's coefficients against jax_privacy's ``toeplitz.inverse_coef``."""
    n = 12
    banded = isinstance(strategy, BandedToeplitz)
    stream = _correlated.CorrelatedNoise(
        "banded" if banded else "blt", n, min_separation=max(1, strategy.bands) if banded else 1, max_participations=3,
        strategy=strategy.coefs_ if banded else strategy.theta + strategy.omega)
    with jax.enable_x64():
        coefs = jax.numpy.asarray(strategy.coefs(n))
        matrix = np.asarray(toeplitz.materialize_lower_triangular(coefs))
        inverse = np.asarray(toeplitz.inverse_coef(coefs))
    rows = np.linalg.norm(np.linalg.inv(matrix), axis=1)
    ours = [stream.release_noise_scale(t) for t in range(n)]
    np.testing.assert_allclose(ours, rows, rtol=1e-9)
    np.testing.assert_allclose(_correlated.inverse_toeplitz_coefs(strategy.coefs(n)), inverse, rtol=1e-9, atol=1e-12)
    assert ours[0] == pytest.approx(1 / strategy.coefs(1)[0])  # the first release: 1 / c_0
    with pytest.raises(ValueError, match=r"release must be in \[0, 12\)"):
        stream.release_noise_scale(n)
