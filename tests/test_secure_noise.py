"""The secure release: discrete Gaussian noise on an integer grid (engine/_secure_noise.py).

Oracles: the exact pmf of the discrete Gaussian, ``exp(-k^2 / (2 s^2))``
normalised (Canonne, Kamath and Steinke 2020, Definition 1), for the sampler;
OpenDP's own composition and zCDP-to-(epsilon, delta) conversion, built here
from its measurements, for the accounting; worked examples for the grid.
"""

from __future__ import annotations

import json
import math

import numpy as np
import opendp.prelude as opendp
import pytest
from scipy import stats

from clipd.engine import _secure_noise as secure

opendp.enable_features("contrib")


def _chi_square_p(draws: np.ndarray, scale: float, tail: int = 10) -> float:
    """p-value of the draws against the discrete Gaussian of ``scale``: bins -tail+1..tail-1, and the two tails."""
    support = np.arange(-60 * math.ceil(scale), 60 * math.ceil(scale) + 1)
    pmf = np.exp(-support.astype(np.float64) ** 2 / (2 * scale ** 2))
    pmf /= pmf.sum()
    inner = (support > -tail) & (support < tail)
    expected = np.concatenate([[pmf[support <= -tail].sum()], pmf[inner], [pmf[support >= tail].sum()]]) * draws.size
    observed = np.concatenate([[np.sum(draws <= -tail)],
                               np.bincount(draws[np.abs(draws) < tail] + tail - 1, minlength=2 * tail - 1),
                               [np.sum(draws >= tail)]])
    return float(stats.chisquare(observed, expected).pvalue)


def test_the_sampler_follows_the_discrete_gaussian_and_a_wrong_one_is_told_apart():
    """2^20 draws at s = 2.5 (two processes) against the exact pmf; the same draws against s = 2.55 fail, and so
    does a float Gaussian of s = 2.5 rounded to integers (a different distribution: variance s^2 + 1/12)."""
    scale = 2.5
    draws = secure.discrete_gaussian(1 << 20, scale, processes=2)
    assert draws.dtype == np.int64 and draws.size == 1 << 20
    assert _chi_square_p(draws, scale) > 1e-6  # a CSPRNG cannot be seeded: a false alarm once in 10^6 runs
    assert _chi_square_p(draws, scale * 1.02) < 1e-9  # negative control: 2% off in scale
    rounded = np.rint(np.random.default_rng(7).normal(0.0, scale, draws.size)).astype(np.int64)
    assert _chi_square_p(rounded, scale) < 1e-9  # negative control: the float sampler rounded
    assert abs(np.mean(draws)) < 5 * scale / math.sqrt(draws.size)


def test_fresh_draws_each_call():
    a, b = secure.discrete_gaussian(4096, 1e6), secure.discrete_gaussian(4096, 1e6)
    assert not np.array_equal(a, b) and np.count_nonzero(a == b) < 10


def test_every_released_value_lies_on_the_grid_and_the_noise_has_the_stated_scale():
    rng = np.random.default_rng(3)
    sums = [rng.standard_normal((300, 7)).astype(np.float32) * 40, rng.standard_normal(900).astype(np.float32)]
    out = secure.release(sums, sensitivity=2.0, noise_multiplier=1.5)
    dimension = 300 * 7 + 900
    assert out.step == 2.0 ** math.floor(math.log2(2.0 * 2 ** -10 / math.sqrt(dimension)))  # a power of two
    assert out.grid_sensitivity == math.ceil(2.0 / out.step) + math.ceil(math.sqrt(dimension))
    assert out.scale == 1.5 * out.grid_sensitivity
    for value, total in zip(out.values, sums):
        assert value.shape == total.shape and value.dtype == np.float64
        on_grid = value / out.step
        assert np.array_equal(on_grid, np.round(on_grid))  # every value a whole number of steps
    noise = np.concatenate([np.ravel(v) - np.ravel(t) for v, t in zip(out.values, sums)]) / out.noise_stddev
    assert 0.93 < np.std(noise) < 1.07  # 3,000 draws: the stddev is within 7% (about 5 standard errors)
    again = secure.release(sums, sensitivity=2.0, noise_multiplier=1.5)
    assert not np.array_equal(again.values[1], out.values[1])  # fresh noise per release


def test_the_grid_sensitivity_covers_rounding_in_opposite_directions():
    """Two sums a hair apart whose every coordinate rounds the other way: the rounding alone moves the grid sum
    by sqrt(d), which the bound must (and does) include."""
    d, step = 400, 2.0 ** -6
    below = (np.arange(d) + 0.5) * step - step * 1e-6  # just under a half step: rounds down
    above = below + step * 2e-6  # just over: rounds up
    moved = float(np.linalg.norm(above - below))
    jump = np.linalg.norm(secure.to_grid(above, step) - secure.to_grid(below, step))
    assert jump == pytest.approx(math.sqrt(d))
    assert jump <= secure.grid_sensitivity(moved, step, d)
    assert secure.grid_sensitivity(moved, step, d) < jump + 2  # and the bound is not slack here
    rng = np.random.default_rng(5)
    for _ in range(200):  # random neighbours: a contribution of norm <= D added anywhere
        base = rng.standard_normal(d) * 3
        delta = rng.standard_normal(d)
        delta *= rng.uniform(0, 1.0) / np.linalg.norm(delta)
        assert (np.linalg.norm(secure.to_grid(base + delta, step) - secure.to_grid(base, step))
                <= secure.grid_sensitivity(1.0, step, d))


def test_a_sum_too_large_for_the_grid_is_refused():
    with pytest.raises(OverflowError, match="does not fit a grid"):
        secure.to_grid(np.array([1e9]), 2.0 ** -30)


def _opendp_epsilon(releases: list[tuple[int, float]], delta: float) -> float:
    """OpenDP's epsilon for discrete Gaussians (sensitivity, scale) on int64 vectors, composed by OpenDP."""
    space = opendp.vector_domain(opendp.atom_domain(T="i64")), opendp.l2_distance(T="i64")
    # Composition maps one input distance through every part: a release of sensitivity k and scale s is the
    # part of scale s / k at distance 1 (the same rho, k^2 / (2 s^2)).
    measurements = [opendp.m.make_gaussian(*space, scale=scale / sensitivity) for sensitivity, scale in releases]
    composed = opendp.c.make_composition(measurements)
    return float(opendp.c.make_zCDP_to_approxDP(composed).map(1).epsilon(delta))


def test_a_ledger_of_secure_releases_spends_what_opendp_says():
    releases = [(1049576, 1.0 * 1049576), (1049576, 1.0 * 1049576), (2050, 0.8 * 2050), (20, 40.0)]
    events = [secure.release_event_json(k, s, 0.5, 10) for k, s in releases]
    for delta in (1e-5, 1e-8):
        assert secure.epsilon(events, delta) == pytest.approx(_opendp_epsilon(releases, delta), rel=1e-9)
    # rho adds up: 1/2 + 1/2 + 1/(2 * 0.64) + 1/8; and the empty ledger spends nothing
    assert sum(secure.release_rho(e) for e in events) == pytest.approx(1 + 1 / 1.28 + 0.125, rel=1e-12)
    assert secure.epsilon([], 1e-5) == 0.0


def test_calibration_spends_the_target():
    z = secure.noise_multiplier_for(3.0, 1e-5, 50)
    assert _opendp_epsilon([(1, z)] * 50, 1e-5) == pytest.approx(3.0, rel=1e-6)
    assert secure.noise_multiplier_for(3.0, 1e-5, 200) == pytest.approx(2 * z, rel=1e-9)  # rho per release / 4


def test_the_secure_release_spends_the_continuous_gaussians_epsilon_with_at_most_0_2_percent_more_noise():
    """With s = z * Dg, a release is 1 / (2 z^2)-zCDP, as the continuous Gaussian of multiplier z: the same epsilon.
    The grid's price is in the noise: s * g over z * D, at most 1 + 2^-10 + g / D (the README's table)."""
    for dimension in (10, 10 ** 6, 10 ** 8):
        z, sensitivity, rounds = 1.0, 1.0, 100
        step, widened, scale = secure.plan(sensitivity, z, dimension)
        continuous = secure.epsilon_of_rho(rounds / (2 * z * z), 1e-5)
        discrete = secure.epsilon([secure.release_event_json(widened, scale, step, dimension)] * rounds, 1e-5)
        assert discrete == pytest.approx(continuous, rel=1e-12)
        assert 1.0 < scale * step / (z * sensitivity) < 1.002


# Through the real server -------------------------------------------------------------------
def _secure(ledger: str, **fields):
    from clipd.client import Privacy

    return Privacy(ledger, 1e-5, noise="secure", accountant="zcdp", **fields)


def _ledger() -> str:
    import uuid

    return f"secure-{uuid.uuid4().hex[:10]}"


def test_a_secure_release_is_on_its_grid_with_the_stated_noise(client):
    layers = {"a": (40, 50), "b": (1000,)}
    privacy = _secure(_ledger(), noise_multiplier=1.0)
    rows = {"a": np.random.default_rng(1).standard_normal((6, 40, 50)).astype(np.float32),
            "b": np.random.default_rng(2).standard_normal((6, 1000)).astype(np.float32)}
    exact = {name: (x / np.maximum(1.0, np.sqrt(np.sum(rows["a"].reshape(6, -1) ** 2, axis=1)
                                                 + np.sum(rows["b"] ** 2, axis=1)) / 0.5
                                   ).reshape((6,) + (1,) * (x.ndim - 1))).sum(axis=0)
             for name, x in rows.items()}  # clipped to 0.5, summed (float64)
    agg = client.create_aggregation(layers, l2_norm_clip=0.5, privacy=privacy)
    client.submit(agg, rows)
    result = client.finalize(agg)
    release, dimension = result.release, 3000
    step = 2.0 ** math.floor(math.log2(0.5 * 2 ** -10 / math.sqrt(dimension)))  # the largest power of two under
    assert release.grid_step == step and release.sensitivity == 0.5
    grid_sensitivity = math.ceil(0.5 / step) + math.ceil(math.sqrt(dimension))
    assert release.grid_noise_scale == grid_sensitivity and release.noise_stddev == grid_sensitivity * step
    assert not release.seeded and json.loads(release.dp_event_json)["discrete_gaussian"]["scale"] == grid_sensitivity
    noise = []
    for name in layers:
        value = result.sums[name]
        assert value.dtype == np.float64 and value.shape == layers[name]
        assert np.array_equal(value / step, np.round(value / step))  # every value a whole number of steps
        noise.append((value - exact[name]).ravel() / release.noise_stddev)
    assert 0.9 < np.std(np.concatenate(noise)) < 1.1  # 3,000 draws of the stated scale


def test_a_secure_ledger_spends_what_opendp_says_and_its_budget_refuses_before_any_contribution(client):
    from clipd.client import FailedPreconditionError

    dimension, bound = 3, 1.0
    step = 2.0 ** math.floor(math.log2(bound * 2 ** -10 / math.sqrt(dimension)))
    grid_sensitivity = math.ceil(bound / step) + math.ceil(math.sqrt(dimension))
    z = 2.0
    one, two, three = (_opendp_epsilon([(grid_sensitivity, z * grid_sensitivity)] * n, 1e-5) for n in (1, 2, 3))
    privacy = _secure(_ledger(), noise_multiplier=z, max_epsilon=(two + three) / 2)
    for n, expected in ((1, one), (2, two)):
        agg = client.create_aggregation({"w": (3,)}, l2_norm_clip=bound, privacy=privacy)
        client.submit(agg, {"w": np.ones((4, 3), np.float32)})
        release = client.finalize(agg).release
        assert release.ledger_epsilon == pytest.approx(expected, rel=1e-9) and release.ledger_releases == n
    assert client.ledger(privacy.ledger_id).epsilon == pytest.approx(two, rel=1e-9)
    with pytest.raises(FailedPreconditionError, match="exhausted"):
        client.create_aggregation({"w": (3,)}, l2_norm_clip=bound, privacy=privacy)  # refused before a Submit
    ledger = client.ledger(privacy.ledger_id)
    assert ledger.accountant == "zcdp" and len(ledger.entries) == 2


def test_secure_noise_is_calibrated_to_a_target_epsilon(client):
    privacy = _secure(_ledger(), target_epsilon=2.0, planned_releases=4)
    agg = client.create_aggregation({"w": (3,)}, l2_norm_clip=1.0, privacy=privacy)
    release = client.finalize(agg).release
    assert _opendp_epsilon([(1, release.noise_multiplier)] * 4, 1e-5) == pytest.approx(2.0, rel=1e-6)


@pytest.mark.parametrize("fields, message", [
    ({"noise_multiplier": 1.0, "accountant": "rdp"}, "zcdp accountant"),
    ({"noise_multiplier": 1.0, "sampling": "poisson", "sampling_rate": 0.1}, "amplification by sampling"),
    ({"noise_multiplier": 1.0, "seed": 3}, "a seed"),
    ({"noise_multiplier": 1.0, "metrics_noise_multiplier": 1.0}, "released statistics"),
    ({"noise_multiplier": 1.0, "noise": "gaussian"}, "zcdp accountant"),  # zcdp accounts secure noise only
])
def test_what_secure_noise_does_not_take_is_an_invalid_argument(client, fields, message):
    from clipd.client import InvalidArgumentError, Privacy

    given = {"noise": "secure", "accountant": "zcdp", **fields}
    with pytest.raises(InvalidArgumentError, match=message):
        client.create_aggregation({"w": (3,)}, l2_norm_clip=1.0, privacy=Privacy(_ledger(), 1e-5, **given))
