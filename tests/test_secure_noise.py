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
    """2^19 draws at s = 1.5 (two processes) against the exact pmf; the same draws against s = 1.53 fail, and so
    does a float Gaussian of s = 1.5 rounded to integers (a different distribution: variance s^2 + 1/12)."""
    scale = 1.5
    draws = secure.discrete_gaussian(1 << 19, scale, processes=2)
    assert draws.dtype == np.int64 and draws.size == 1 << 19
    assert _chi_square_p(draws, scale, tail=6) > 1e-6  # a CSPRNG cannot be seeded: a false alarm once in 10^6 runs
    assert _chi_square_p(draws, scale * 1.02, tail=6) < 1e-9  # negative control: 2% off in scale (p ~ 1e-77)
    rounded = np.rint(np.random.default_rng(7).normal(0.0, scale, draws.size)).astype(np.int64)
    assert _chi_square_p(rounded, scale, tail=6) < 1e-9  # negative control: the float sampler rounded (p ~ 1e-64)
    assert abs(np.mean(draws)) < 5 * scale / math.sqrt(draws.size)


def test_fresh_draws_each_call():
    a, b = secure.discrete_gaussian(4096, 1e6), secure.discrete_gaussian(4096, 1e6)
    assert not np.array_equal(a, b) and np.count_nonzero(a == b) < 10


def _fixed_point(shapes, bound: float, step: float):
    from clipd.engine import ClipAccumulator, ClipPolicy, LayerSpec

    layers = [LayerSpec(f"l{k}", shape) for k, shape in enumerate(shapes)]
    return ClipAccumulator(layers, ClipPolicy(l2_norm_clip=bound), fixed_point_step=step)


def _summed(acc, rows, order, batch: int):
    """The accumulator's per-layer sums of ``rows[order]``, fed in batches of ``batch``."""
    state = acc.init()
    for start in range(0, len(order), batch):
        chosen = order[start:start + batch]
        state = acc.update(state, [x[chosen] for x in rows], np.ones(len(chosen), bool))
    return state.sums


def _grid_sum(acc, rows, order, batch: int) -> np.ndarray:
    """The fixed-point sum of ``rows[order]`` in grid steps (exact integers), all layers flat."""
    return np.concatenate([s.ravel() for s in _summed(acc, rows, order, batch)]) / acc.fixed_point_step


def test_every_released_value_lies_on_the_grid_and_the_noise_has_the_stated_scale():
    shapes, bound, z = [(300, 7), (900,)], 2.0, 1.5
    dimension = 300 * 7 + 900
    step, widened, scale = secure.plan(bound, 1, z, dimension)
    assert step == 2.0 ** math.floor(math.log2(bound * 2 ** -10 / math.sqrt(dimension)))  # a power of two
    assert widened == math.ceil(bound / step * (1 + 2 ** -23) + math.ceil(math.sqrt(dimension)) / 2)
    acc = _fixed_point(shapes, bound, step)
    rng = np.random.default_rng(3)
    rows = [rng.standard_normal((12, *shape)).astype(np.float32) for shape in shapes]
    state = acc.update(acc.init(), rows, np.ones(12, bool))
    out = secure.release(state.sums, step, scale)
    for value, total in zip(out.values, state.sums):
        assert value.shape == total.shape and value.dtype == np.float64
        on_grid = value / out.step
        assert np.array_equal(on_grid, np.round(on_grid))  # every value a whole number of steps
    noise = np.concatenate([np.ravel(v) - np.ravel(t) for v, t in zip(out.values, state.sums)]) / out.noise_stddev
    assert 0.93 < np.std(noise) < 1.07  # 3,000 draws: the stddev is within 7% (about 5 standard errors)
    again = secure.release(state.sums, step, scale)
    assert not np.array_equal(again.values[1], out.values[1])  # fresh noise per release


def test_fixed_point_sums_are_the_same_in_casacuberta_orders_and_one_example_moves_them_by_its_own_grid_vector():
    """Casacuberta et al. (2022) move a float sum past its sensitivity by choosing the order of the additions (large
    values first, then many small ones that round away, or the reverse). The fixed-point sum is the same in every
    order and batching, and removing one example moves it by exactly that example's integers, within the bound;
    the float32 accumulator on the same data and orders is not order-free (the negative control)."""
    from clipd.engine import ClipAccumulator, ClipPolicy, LayerSpec

    rng = np.random.default_rng(11)
    d, n, bound = 64, 600, 1.0
    big = np.zeros((40, d), np.float32)
    big[:, 0] = 1.0  # examples at the bound, all in one coordinate: a large running sum there
    small = (rng.standard_normal((n - 40, d)) * 3e-4).astype(np.float32)  # a few dozen float32 ulps of it each
    data = [np.concatenate([big, small])]
    magnitude = np.abs(data[0]).sum(axis=1)
    orders = {"as given": np.arange(n), "big first": np.argsort(-magnitude, kind="stable"),
              "small first": np.argsort(magnitude, kind="stable"), "reversed": np.arange(n)[::-1],
              "interleaved": np.argsort(np.arange(n) % 7, kind="stable"),
              **{f"random {k}": np.random.default_rng(k).permutation(n) for k in range(3)}}
    step = secure.grid_step(bound, d)
    fixed = _fixed_point([(d,)], bound, step)
    sums = {(name, batch): _grid_sum(fixed, data, order, batch) for name, order in orders.items() for batch in (1, 64)}
    first = next(iter(sums.values()))
    assert all(np.array_equal(total, first) for total in sums.values())  # exact: one sum for every order
    assert np.array_equal(first, np.round(first))
    limit = secure.grid_sensitivity(bound, step, d)
    for removed in (0, 39, 40, n - 1):  # a big example and small ones, wherever they were in the order
        rest = np.delete(orders["big first"], np.flatnonzero(orders["big first"] == removed))
        alone = _grid_sum(fixed, data, np.array([removed]), 1)
        assert np.array_equal(first - _grid_sum(fixed, data, rest, 64), alone)
        assert np.linalg.norm(alone) <= limit
    floating = ClipAccumulator([LayerSpec("l0", (d,))], ClipPolicy(l2_norm_clip=bound))
    float_sums = {name: np.asarray(_summed(floating, data, order, 1)[0]) for name, order in orders.items()}
    assert len({total.tobytes() for total in float_sums.values()}) > 1  # floats: the order shows in the sum


def test_the_grid_sensitivity_is_reached_by_an_example_whose_every_coordinate_rounds_up():
    """An example under the bound whose every coordinate sits just past a half step above the grid: each rounds
    up by ~1/2, so its grid vector is ||x|| / g + sqrt(d) / 2 long, which the bound must (and does) cover."""
    d, bound = 400, 1.0
    step = secure.grid_step(bound, d)
    assert step == 2.0 ** -15  # sqrt(400) g <= 2^-10
    steps = math.floor(bound / (math.sqrt(d) * step) - 0.5) - 1  # whole steps per coordinate, under the bound
    example = np.full((1, d), (steps + 0.5001) * step, np.float32)
    assert np.linalg.norm(example) < bound * (1 - 1e-3)  # not clipped
    moved = _grid_sum(_fixed_point([(d,)], bound, step), [example], np.array([0]), 1)
    assert np.array_equal(moved, np.full(d, steps + 1.0))  # every coordinate rounded up
    reach = np.linalg.norm(moved) - np.linalg.norm(example.astype(np.float64)) / step
    assert reach == pytest.approx(math.sqrt(d) / 2, rel=1e-3)  # the sqrt(d) / 2 term, used in full
    assert np.linalg.norm(moved) <= secure.grid_sensitivity(bound, step, d)


def test_a_release_refuses_sums_off_the_grid_or_too_large_for_it():
    with pytest.raises(ValueError, match="not on the grid"):
        secure.on_grid(np.array([0.5, 0.3]), 0.25)
    with pytest.raises(OverflowError, match="does not fit a grid"):
        secure.on_grid(np.array([1e9]), 2.0 ** -30)


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


def test_the_secure_release_spends_the_continuous_gaussians_epsilon_with_a_little_more_noise():
    """With s = z * Dg, a release is 1 / (2 z^2)-zCDP, as the continuous Gaussian of multiplier z: the same epsilon.
    The grid's price is in the noise: s * g over z * C is 1 + (sqrt(d) / 2 + a ceiling) g / C: under 0.1% at
    d = 10^6, where the grid can be fine enough, and under 1% at 10^8, where its floor C 2^-19 decides."""
    for dimension, at_most in ((10, 1.001), (10 ** 6, 1.001), (10 ** 8, 1.0096)):
        z, bound, rounds = 1.0, 1.0, 100
        step, widened, scale = secure.plan(bound, 1, z, dimension)
        discrete = secure.epsilon([secure.release_event_json(widened, scale, step, dimension)] * rounds, 1e-5)
        assert discrete == pytest.approx(_opendp_epsilon([(1, z)] * rounds, 1e-5), rel=1e-9)  # OpenDP, rho = 1/(2z^2)
        widening = scale * step / (z * bound)
        assert 1.0 < widening <= 1 + (math.ceil(math.sqrt(dimension)) / 2 + 1) * step / bound
        assert widening < at_most


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
    grid_sensitivity = math.ceil(0.5 / step * (1 + 2 ** -23) + math.ceil(math.sqrt(dimension)) / 2)
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
    grid_sensitivity = math.ceil(bound / step * (1 + 2 ** -23) + math.ceil(math.sqrt(dimension)) / 2)
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
    grid_sensitivity = math.ceil(1.0 / release.grid_step * (1 + 2 ** -23) + math.ceil(math.sqrt(3)) / 2)
    assert release.grid_noise_scale == pytest.approx(release.noise_multiplier * grid_sensitivity, rel=1e-12)
    assert release.ledger_epsilon == pytest.approx(_opendp_epsilon([(1, release.noise_multiplier)], 1e-5), rel=1e-9)


def test_a_power_of_two_bound_over_many_coordinates_sits_on_the_finest_grid(client):
    """C = 1 over 70,000 coordinates: the grid's floor C 2^-19 decides, C / g = 2^19 exactly, and the fixed-point
    sum still takes it (a regression: the accumulator once asked C / g < 2^19 and refused every such aggregation)."""
    privacy = _secure(_ledger(), noise_multiplier=0.0)
    agg = client.create_aggregation({"w": (70_000,)}, l2_norm_clip=1.0, privacy=privacy)
    rows = (np.random.default_rng(4).standard_normal((3, 70_000)) * 1e-3).astype(np.float32)
    client.submit(agg, {"w": rows})
    result = client.finalize(agg)
    assert result.release.grid_step == 2.0 ** -19
    np.testing.assert_array_equal(result.sums["w"], np.rint(rows.astype(np.float64) * 2 ** 19).sum(axis=0) / 2 ** 19)


def test_replace_one_doubles_the_grid_sensitivity_and_keeps_the_epsilon(client):
    """Replacing one example moves the fixed-point sum by two examples' grid vectors: twice the add/remove bound
    (each rounding included), so the noise doubles and the epsilon per release stays that of z."""
    results = {}
    for neighbouring in ("add_remove_one", "replace_one"):
        privacy = _secure(_ledger(), noise_multiplier=1.0, neighbouring=neighbouring)
        results[neighbouring] = client.finalize(
            client.create_aggregation({"w": (3,)}, l2_norm_clip=1.0, privacy=privacy)).release
    step = results["replace_one"].grid_step
    one = 1.0 / step * (1 + 2 ** -23) + math.ceil(math.sqrt(3)) / 2
    assert results["add_remove_one"].grid_noise_scale == math.ceil(one)
    assert results["replace_one"].grid_noise_scale == math.ceil(2 * one) and results["replace_one"].sensitivity == 2.0
    for release in results.values():
        assert release.ledger_epsilon == pytest.approx(_opendp_epsilon([(1, 1.0)], 1e-5), rel=1e-9)


def test_a_fixed_point_delta_is_flushed_before_its_limbs_could_overflow(server, client, monkeypatch):
    """The worker flushes a fixed-point delta into the host's totals before it holds FIXED_POINT_DELTA_ROWS rows.
    With that limit lowered to one step's rows, every step is flushed on its own; the sum stays exact."""
    from clipd.server import aggregations
    from clipd.server.summing import slots

    flushes = []
    absorb = aggregations.Aggregation.absorb  # (the worker's flush: its delta into the shard's totals)
    monkeypatch.setattr(aggregations.Aggregation, "absorb",
                        lambda self, shard, *delta: (flushes.append(self.id), absorb(self, shard, *delta))[1])
    privacy = _secure(_ledger(), noise_multiplier=0.0)
    agg = client.create_aggregation({"w": (50,)}, l2_norm_clip=1.0, privacy=privacy)
    rows_per_step = server.registry.get(agg).device_rows
    monkeypatch.setattr(slots, "FIXED_POINT_DELTA_ROWS", rows_per_step)
    batches = [{"w": (np.random.default_rng(k).standard_normal((rows_per_step, 50)) * 0.01).astype(np.float32)}
               for k in range(12)]
    client.submit(agg, batches)
    result = client.finalize(agg)
    assert flushes.count(agg) >= 12  # one flush per step at least: no delta outgrew one step
    step = result.release.grid_step
    expected = sum(np.rint(b["w"].astype(np.float64) / step).sum(axis=0) for b in batches) * step
    np.testing.assert_array_equal(result.sums["w"], expected)


@pytest.mark.parametrize("fields, message", [
    ({"noise_multiplier": 1.0, "accountant": "rdp"}, "zcdp accountant"),
    ({"noise_multiplier": 1.0, "sampling": "poisson", "sampling_rate": 0.1}, "amplification by sampling"),
    ({"noise_multiplier": 1.0, "seed": 3}, "a seed"),
    ({"noise_multiplier": 1.0, "metrics_noise_multiplier": 1.0}, "released statistics"),
    ({"noise_multiplier": 1.0, "noise": "gaussian"}, "zcdp accountant"),  # zcdp accounts secure noise only
    ({"noise_multiplier": 1.0, "public_denominator": 4.0, "adaptive": "yes"}, "adaptive clipping"),
])
def test_what_secure_noise_does_not_take_is_an_invalid_argument(client, fields, message):
    from clipd.client import Adaptive, InvalidArgumentError, Privacy

    given = {"noise": "secure", "accountant": "zcdp", **fields}
    if given.get("adaptive") == "yes":
        given["adaptive"] = Adaptive(count_stddev=1.0, initial_bound=1.0)
    with pytest.raises(InvalidArgumentError, match=message):
        client.create_aggregation({"w": (3,)}, l2_norm_clip=1.0, privacy=Privacy(_ledger(), 1e-5, **given))


def test_secure_noise_needs_a_global_bound(client):
    from clipd.client import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="GLOBAL clip policy"):
        client.create_aggregation({"w": (3,), "b": (2,)}, policy="per_layer_uniform", l2_norm_clip=1.0,
                                  privacy=_secure(_ledger(), noise_multiplier=1.0))
