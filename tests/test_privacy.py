"""Private releases through the real server: noise, accounting, budgets, adaptive clipping, withheld statistics.

Oracles: dp_accounting's accountants and calibration (composed here from events
the test builds itself), jax_privacy's DP-SGD accountant, TF Privacy 0.9.0's
QuantileAdaptiveClipSumQuery (golden values computed by the real library in a
separate environment: tests/golden/make_tf_privacy_adaptive.py), the noise
formulas of Opacus / TFF / Flower as worked examples, and scipy's chi-square
and normal quantiles for the statistical tests (each false-failure probability
at most 1e-6).
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
import sys
import threading
import uuid

import background
import dp_accounting
import grpc
import httpx
import jax
import numpy as np
import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from helpers import wait_until
from scipy import stats as scipy_stats

from clipd.client import Adaptive, FailedPreconditionError, InvalidArgumentError, NotFoundError, Privacy
from clipd.v1 import clipd_pb2 as pb

GOLDEN = pathlib.Path(__file__).parent / "golden" / "tf_privacy_adaptive.json"
Z_1E6 = scipy_stats.norm.isf(0.5e-6)  # two-sided normal quantile: P(|N(0,1)| > Z_1E6) = 1e-6


def ledger_name() -> str:
    return f"ledger-{uuid.uuid4().hex[:10]}"


def rdp_epsilon(events, delta, relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE) -> float:
    accountant = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
    for event in events:
        accountant.compose(event)
    return accountant.get_epsilon(delta)


def pld_epsilon(events, delta) -> float:
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    for event in events:
        accountant.compose(event)
    return accountant.get_epsilon(delta)


def release_rounds(client, privacy: Privacy, rounds: int, layers=None, examples=None) -> list:
    """``rounds`` aggregations on ``privacy``'s ledger, each given ``examples``; their releases."""
    layers = layers or {"w": (3,)}
    out = []
    for _ in range(rounds):
        agg = client.create_aggregation(layers, l2_norm_clip=1.0, privacy=privacy)
        if examples is not None:
            client.submit(agg, examples)
        out.append(client.finalize(agg).release)
    return out


# Accounting ---------------------------------------------------------------------------------
def test_a_ledger_read_once_still_sees_the_entries_another_process_commits():
    """Ledgers keeps the events it has read and asks the store for newer ones only; on a shared store another
    server commits releases too, and each must count."""
    from clipd.server.privacy import Ledgers
    from clipd.server.stores.base import AggregationRecord, LedgerEntry, LedgerRecord, MemoryStore

    store = MemoryStore()
    store.ensure_ledger(LedgerRecord("L", "{}"))
    ours = Ledgers(store)
    assert len(ours.events("L")) == 0
    for position, event in enumerate(['{"e": 0}', '{"e": 1}', '{"e": 2}']):
        store.create(AggregationRecord(f"a{position}", "{}"))  # released by another server on this store
        store.commit_release(f"a{position}", b"r", "L", LedgerEntry(f"a{position}", event, 0.0, 1.0), position,
                             finished=1.0)
        seen = ours.events("L")  # (the counts of the events: what the ledger's epsilon is asked of)
        assert len(seen) == position + 1
        assert sorted(seen.elements()) == [f'{{"e": {k}}}' for k in range(position + 1)]


def test_a_long_mixed_ledger_has_dp_accounting_epsilon_event_by_event():
    """The ledger's RDP is summed from each distinct event's curve (computed once): it must equal
    dp_accounting's RdpAccountant composing every event in turn, here 30 steps of a trainer with two
    other kinds of release between them, under both neighbouring relations."""
    from clipd.engine import _privacy as dp

    step = dpe.PoissonSampledDpEvent(0.05, dpe.GaussianDpEvent(1.1))
    other = dpe.PoissonSampledDpEvent(0.2, dpe.ComposedDpEvent([dpe.GaussianDpEvent(2.0), dpe.GaussianDpEvent(9.0)]))
    events = [step] * 18 + [other, dpe.GaussianDpEvent(30.0)] + [step] * 12
    oracle = rdp_epsilon(events, 1e-6)
    got = dp.epsilon(events, 1e-6, dp.Accountant.RDP, dp.Neighbouring.ADD_REMOVE_ONE)
    assert got == pytest.approx(oracle, rel=1e-12)
    assert 0.5 < oracle < 100.0  # a meaningful ledger, neither 0 nor inf
    replace = [dpe.GaussianDpEvent(3.0)] * 20
    assert dp.epsilon(replace, 1e-5, dp.Accountant.RDP, dp.Neighbouring.REPLACE_ONE) == pytest.approx(
        rdp_epsilon(replace, 1e-5, dp_accounting.NeighboringRelation.REPLACE_ONE), rel=1e-12)


def test_ledger_epsilon_equals_dp_accounting_rdp_and_pld(client):
    q, z, delta = 0.01, 1.0, 1e-5
    for accountant, oracle in (("rdp", rdp_epsilon), ("pld", pld_epsilon)):
        privacy = Privacy(ledger_name(), delta, noise_multiplier=z, sampling="poisson", sampling_rate=q,
                          accountant=accountant)
        releases = release_rounds(client, privacy, 3)
        event = dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(z))
        expected = [oracle([event] * i, delta) for i in (1, 2, 3)]  # each computed once (PLD: ~1 s apiece)
        for i, release in enumerate(releases, start=1):
            assert release.ledger_epsilon == pytest.approx(expected[i - 1], rel=1e-6)
            assert release.epsilon == pytest.approx(expected[0], rel=1e-6)
            assert release.ledger_releases == i
        ledger = client.ledger(privacy.ledger_id)
        assert ledger.accountant == accountant and len(ledger.entries) == 3
        stored = [dpe.DpEvent.from_named_tuple(_named(json.loads(e.dp_event_json))) for e in ledger.entries]
        assert stored == [event] * 3  # the events as written, read back with dp_accounting itself
        assert ledger.epsilon == pytest.approx(expected[2], rel=1e-6)


def _named(value):
    import collections

    if isinstance(value, dict):
        fields = {k: _named(v) for k, v in value.items()}
        return collections.namedtuple("E", list(fields))(**fields)
    if isinstance(value, list):
        return [_named(v) for v in value]
    return value


def test_reference_values_of_dp_md():
    """The engine's accountant wrapper on DP.md's worked figures (computed there with dp-accounting 0.6.0)."""
    from clipd.engine import _privacy as dp

    poisson = dp.Sampling("poisson", 0.01)
    steps = [dpe.SelfComposedDpEvent(poisson.wrap(dpe.GaussianDpEvent(1.0)), 1000)]
    assert dp.epsilon(steps, 1e-5, "rdp", "add_remove_one") == pytest.approx(2.101, abs=5e-4)
    assert dp.epsilon(steps, 1e-5, "pld", "add_remove_one") == pytest.approx(1.828, abs=5e-4)
    plain = [dpe.SelfComposedDpEvent(dpe.GaussianDpEvent(1.0), 100)]
    assert dp.epsilon(plain, 1e-5, "rdp", "add_remove_one") == pytest.approx(96.1, abs=0.05)
    assert dp.epsilon(plain, 1e-5, "pld", "add_remove_one") == pytest.approx(91.8, abs=0.05)


def test_epsilon_agrees_with_jax_privacy_dpsgd_accountant(client):
    from jax_privacy.accounting import accountants, analysis

    n, batch, z, delta, rounds = 10_000, 100, 1.2, 1e-5, 4
    privacy = Privacy(ledger_name(), delta, noise_multiplier=z, sampling="poisson", sampling_rate=batch / n,
                      accountant="pld")
    release = release_rounds(client, privacy, rounds)[-1]
    params = analysis.DpParams(noise_multipliers=z, num_samples=n, batch_size=batch, delta=delta)
    jax_privacy = analysis.DpsgdTrainingAccountant(
        accountants.PldAccountantConfig(value_discretization_interval=1e-4)).compute_epsilon(rounds, params)
    assert release.ledger_epsilon == pytest.approx(jax_privacy, rel=1e-3)


def test_calibrated_noise_multiplier_matches_mechanism_calibration(client):
    q, releases, target, delta = 0.01, 1000, 3.0, 1e-5
    privacy = Privacy(ledger_name(), delta, target_epsilon=target, planned_releases=releases, sampling="poisson",
                      sampling_rate=q)
    release = release_rounds(client, privacy, 1)[0]
    expected = dp_accounting.calibrate_dp_mechanism(
        rdp_privacy_accountant.RdpAccountant,
        lambda z: dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(z)), releases),
        target, delta)
    assert release.noise_multiplier == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert release.noise_multiplier == pytest.approx(0.8646, abs=1e-4)  # DP.md's figure


def test_noise_split_keeps_the_total_noise_multiplier(client):
    """Adaptive count and released statistics take their share: the release as a whole is still Gaussian(z)."""
    z, sigma_b, z_m, delta = 1.0, 2.5, 3.0, 1e-5
    privacy = Privacy(ledger_name(), delta, noise_multiplier=z, public_denominator=4.0, metrics_noise_multiplier=z_m,
                      adaptive=Adaptive(count_stddev=sigma_b, initial_bound=1.0))
    release = release_rounds(client, privacy, 1)[0]
    z_v = release.value_noise_multiplier
    assert z_v ** -2 + (2 * sigma_b) ** -2 + z_m ** -2 == pytest.approx(z ** -2, rel=1e-12)
    gaussian = [dpe.GaussianDpEvent(z)]
    assert release.epsilon == pytest.approx(rdp_epsilon(gaussian, delta), rel=1e-6)
    composed = dpe.ComposedDpEvent([dpe.GaussianDpEvent(z_v), dpe.GaussianDpEvent(2 * sigma_b), dpe.GaussianDpEvent(z_m)])
    assert release.epsilon == pytest.approx(rdp_epsilon([composed], delta), rel=1e-6)
    assert release.noise_stddev == pytest.approx(z_v * 1.0)
    assert release.statistics_noise_stddev == pytest.approx(z_m * math.sqrt(1 + 2))  # one layer: sqrt(K + 2)


# Noise ----------------------------------------------------------------------------------------
def test_noise_stddev_is_the_anchors_formula(client):
    """Opacus: noise_multiplier * max_grad_norm; TFF: clip * z (worked formulas: torch and TFF aren't installed)."""
    z, c = 1.3, 0.7
    privacy = Privacy(ledger_name(), 1e-5, noise_multiplier=z)
    agg = client.create_aggregation({"w": (3,)}, l2_norm_clip=c, privacy=privacy)
    release = client.finalize(agg).release
    assert release.noise_stddev == pytest.approx(z * c, rel=1e-12)  # opacus, TFF (Flower's: tests/flower)
    replace = Privacy(ledger_name(), 1e-5, noise_multiplier=z, neighbouring="replace_one")
    agg = client.create_aggregation({"w": (3,)}, l2_norm_clip=c, privacy=replace)
    assert client.finalize(agg).release.noise_stddev == pytest.approx(2 * z * c, rel=1e-12)  # sensitivity 2C


def test_per_layer_sensitivity_is_the_root_sum_of_squares(client):
    """Opacus' DPPerLayerOptimizer sets max_grad_norm = sqrt(sum C_k^2): 3-4-12 gives 13."""
    privacy = Privacy(ledger_name(), 1e-5, noise_multiplier=2.0)
    agg = client.create_aggregation({"a": (2,), "b": (2,), "c": (2,)}, policy="per_layer_explicit",
                                    layer_clips=[3.0, 4.0, 12.0], privacy=privacy)
    release = client.finalize(agg).release
    assert release.sensitivity == pytest.approx(13.0) and release.noise_stddev == pytest.approx(26.0)


def _noise_release(client, seed=None, ledger=None, z=1.0, clip=2.0):
    privacy = Privacy(ledger or ledger_name(), 1e-5, noise_multiplier=z, seed=seed)
    agg = client.create_aggregation({"a": (200, 200), "b": (25536,)}, l2_norm_clip=clip, privacy=privacy)
    result = client.finalize(agg)
    return np.concatenate([result.sums["a"].ravel(), result.sums["b"].ravel()]).astype(np.float64), result.release


def test_released_noise_has_the_stated_mean_and_variance_and_is_independent(client):
    ledger = ledger_name()
    first, release = _noise_release(client, ledger=ledger)
    second, _ = _noise_release(client, ledger=ledger)
    n, sigma = first.size, release.noise_stddev
    assert sigma == pytest.approx(2.0) and not release.seeded
    for x in (first, second):
        assert abs(x.mean()) <= Z_1E6 * sigma / math.sqrt(n)  # mean 0
        chi2 = float(np.sum((x / sigma) ** 2))  # sum of n squared N(0,1): chi-square with n degrees
        assert scipy_stats.chi2.ppf(0.5e-6, n) <= chi2 <= scipy_stats.chi2.isf(0.5e-6, n)
    # Independent across releases, and across the two layers of one release: Pearson r * sqrt(n) ~ N(0, 1).
    assert abs(np.corrcoef(first, second)[0, 1]) * math.sqrt(n) <= Z_1E6
    half = 25536
    assert abs(np.corrcoef(first[:half], first[-half:])[0, 1]) * math.sqrt(half) <= Z_1E6
    assert not np.array_equal(first, second)


def _draws(shapes) -> list[str]:
    """The Gaussian draws in the release's noise program for float32 layers of ``shapes`` (its StableHLO calls
    of jax.random's ``_normal``), lowered from shapes alone."""
    import re

    import jax

    from clipd.engine import _privacy as dp

    values = tuple(jax.ShapeDtypeStruct(shape, np.float32) for shape in shapes)
    text = dp._noised.lower(dp.fresh_key(1), values, jax.ShapeDtypeStruct((), np.float64)).as_text()
    return re.findall(r"call @_normal(?:_\d+)?\(", text)


def test_a_release_draws_its_noise_once_per_group_of_layers_not_once_per_layer():
    """Each draw costs XLA about a third of a second to compile here: a program that drew once per layer made a
    model of 64 layers wait 9 s for its first release. Layers of one dtype are drawn together up to NOISE_GROUP
    elements; a larger layer alone (its own draw, as large models' layers are). The draws' statistics are
    test_released_noise_has_the_stated_mean_and_variance_and_is_independent's (two layers drawn together)."""
    from clipd.engine import _privacy as dp

    mlp = [(32, 64), (32,), (10, 32), (10,)]
    assert len(_draws(mlp * 16)) == 1  # 64 layers, 155k elements: one draw
    big = (dp.NOISE_GROUP,)
    assert len(_draws([big, (3,), (4,)])) == 2  # the large layer alone, the two small ones together
    assert len(_draws([(3,), big, (4,), big])) == 4  # runs of consecutive layers only
    assert dp.noise_groups([(3,), big, (4,), (5,)], ["float32"] * 4) == ((0,), (1,), (2, 3))
    assert dp.noise_groups([(3,), (4,), (5,)], ["float32", "float64", "float64"]) == ((0,), (1, 2))


_backend_compiles: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: _backend_compiles.append(event) if "backend_compile" in event else None)


def test_a_private_aggregation_has_its_release_noise_compiled_before_it_is_finalized(client):
    """Its noise program (per layer shapes and sum dtypes) compiles on a thread as it is made (prepare_noise): for
    a DP-SGD trainer's first step, beside its sums' program; for a round, while the clients send. Its release then
    compiles nothing (after one release of other shapes: the keys and statistics programs are the same for all)."""
    _noise_release(client)  # (the programs any release runs, compiled)
    agg = client.create_aggregation({"a": (211, 3), "b": (17, 5)}, l2_norm_clip=2.0,  # (shapes of this test alone)
                                    privacy=Privacy(ledger_name(), 1e-5, noise_multiplier=1.0))
    wait_until(lambda: not any(t.name == "clipd-noise-compile" for t in threading.enumerate()), 60,
               "the noise program's compilation")
    compiled = len(_backend_compiles)
    result = client.finalize(agg)
    assert _backend_compiles[compiled:] == []
    assert result.sums["a"].shape == (211, 3) and np.std(result.sums["a"]) > 0.5  # noised (stddev 2)


def test_seeded_mode_reproduces_and_says_so(client):
    a, release_a = _noise_release(client, seed=1234)
    b, release_b = _noise_release(client, seed=1234)
    c, _ = _noise_release(client, seed=1235)
    assert release_a.seeded and release_b.seeded
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_seeded_releases_of_one_ledger_do_not_share_noise(client):
    ledger = ledger_name()
    a, _ = _noise_release(client, seed=7, ledger=ledger)
    b, _ = _noise_release(client, seed=7, ledger=ledger)
    assert abs(np.corrcoef(a, b)[0, 1]) * math.sqrt(a.size) <= Z_1E6  # subtracting them must not cancel noise


def test_second_finalize_returns_the_same_release(client):
    privacy = Privacy(ledger_name(), 1e-5, noise_multiplier=1.0)
    agg = client.create_aggregation({"w": (64,)}, l2_norm_clip=1.0, privacy=privacy)
    client.submit(agg, {"w": np.ones((5, 64), np.float32)})
    first, second = client.finalize(agg), client.finalize(agg)
    np.testing.assert_array_equal(first.sums["w"], second.sums["w"])
    assert first.release == second.release
    assert len(client.ledger(privacy.ledger_id).entries) == 1


def test_mean_divides_by_the_public_denominator(client):
    privacy = Privacy(ledger_name(), 1e-5, noise_multiplier=0.0, public_denominator=8.0, release_mean=True)
    agg = client.create_aggregation({"w": (4,)}, l2_norm_clip=10.0, privacy=privacy)
    client.submit(agg, {"w": np.ones((5, 4), np.float32)})  # 5 contributions, public denominator 8
    result = client.finalize(agg)
    np.testing.assert_allclose(result.sums["w"], np.full(4, 5 / 8), rtol=1e-6)
    assert result.release.mean and result.release.denominator == 8.0
    assert math.isinf(result.release.epsilon)  # z = 0: no privacy, and the ledger says so


# Budgets ----------------------------------------------------------------------------------------
def test_budget_refuses_at_creation_with_the_numbers(client):
    z, delta = 1.0, 1e-5
    two = rdp_epsilon([dpe.GaussianDpEvent(z)] * 2, delta)
    three = rdp_epsilon([dpe.GaussianDpEvent(z)] * 3, delta)
    privacy = Privacy(ledger_name(), delta, noise_multiplier=z, max_epsilon=(two + three) / 2)
    release_rounds(client, privacy, 1)
    open_one = client.create_aggregation({"w": (3,)}, privacy=privacy)  # reserves the second release
    with pytest.raises(FailedPreconditionError) as refused:
        client.create_aggregation({"w": (3,)}, privacy=privacy)  # a third would pass the budget
    assert "exhausted" in refused.value.details and f"{three:.6g}" in refused.value.details
    assert client.finalize(open_one).release.ledger_epsilon == pytest.approx(two, rel=1e-6)
    with pytest.raises(FailedPreconditionError):
        client.create_aggregation({"w": (3,)}, privacy=privacy)
    ledger = client.ledger(privacy.ledger_id)
    assert len(ledger.entries) == 2 and ledger.budget_left == pytest.approx((two + three) / 2 - two, rel=1e-6)


def test_budget_is_checked_again_at_finalize():
    """Another writer of the same ledger (another process) spends it meanwhile: the release is refused."""
    from clipd.engine import ClipPolicy, LayerSpec
    from clipd.engine import _privacy as dp
    from clipd.server.aggregations import Aggregation, AggregationSpec
    from clipd.server.errors import FailedPrecondition
    from clipd.server.privacy import Ledgers
    from clipd.server.stores.base import AggregationRecord, LedgerEntry, MemoryStore

    store = MemoryStore()
    ledgers = Ledgers(store)
    policy = dp.PrivacyPolicy("L", 1e-5, noise_multiplier=1.0, max_epsilon=6.0)
    layers = (LayerSpec("w", (3,)),)
    plan = policy.plan(1.0, layers)
    aggregation = Aggregation("a", AggregationSpec(layers, ClipPolicy(), privacy=policy), 8, 1 << 20, plan=plan)
    ledgers.admit(aggregation, policy, plan, lambda entry: store.create(AggregationRecord("a", "{}")))
    event = dp.event_to_json(dpe.GaussianDpEvent(1.0))
    store.commit_release("a", b"", "L", LedgerEntry("elsewhere", event, 0.0, 4.73), 0, 0.0)  # spent elsewhere
    with pytest.raises(FailedPrecondition, match="exhausted"):
        ledgers.release(aggregation, aggregation.totals, (np.float32,))
    assert len(store.ledger_entries("L")) == 1
    assert store.get("a").state == "failed" and "exhausted" in store.get("a").reason  # not recovered as open


def test_a_ledger_keeps_its_configuration(client):
    ledger = ledger_name()
    client.create_aggregation({"w": (3,)}, privacy=Privacy(ledger, 1e-5, noise_multiplier=1.0))
    with pytest.raises(FailedPreconditionError, match="exists with"):
        client.create_aggregation({"w": (3,)}, privacy=Privacy(ledger, 1e-6, noise_multiplier=1.0))


@pytest.mark.parametrize("privacy, message", [
    (Privacy("", 1e-5, noise_multiplier=1.0), "ledger_id"),
    (Privacy("l", 0.0, noise_multiplier=1.0), "delta"),
    (Privacy("l", 1e-5), "noise_multiplier"),
    (Privacy("l", 1e-5, target_epsilon=1.0), "planned_releases"),
    (Privacy("l", 1e-5, noise_multiplier=1.0, sampling="poisson", sampling_rate=0.1, neighbouring="replace_one"),
     "Poisson"),
    (Privacy("l", 1e-5, noise_multiplier=1.0, neighbouring="replace_one", accountant="pld"), "RDP only"),
    (Privacy("l", 1e-5, noise_multiplier=1.0, sampling="fixed_size", population=10, sample_size=2), "replace-one"),
    (Privacy("l", 1e-5, noise_multiplier=1.0, adaptive=Adaptive()), "public_denominator"),
    (Privacy("l", 1e-5, noise_multiplier=1.0, public_denominator=5, adaptive=Adaptive(count_stddev=0.5)),
     "leave nothing"),
    (Privacy("l", 1e-5, noise_multiplier=1.0, public_denominator=5, adaptive=Adaptive(count_stddev=0.0)),
     "count_stddev > 0"),  # an un-noised count would leak through the next bound
])
def test_unfit_privacy_policies_are_invalid_arguments(client, privacy, message):
    with pytest.raises(InvalidArgumentError, match=message):
        client.create_aggregation({"w": (3,)}, privacy=privacy)


def test_adaptive_clipping_needs_a_global_bound_and_noise_needs_a_finite_one(client):
    adaptive = Privacy("l", 1e-5, noise_multiplier=1.0, public_denominator=5, adaptive=Adaptive(count_stddev=3.0))
    with pytest.raises(InvalidArgumentError, match="GLOBAL"):
        client.create_aggregation({"w": (3,)}, policy="per_layer_uniform", privacy=adaptive)
    with pytest.raises(InvalidArgumentError, match="infinite bound"):
        client.create_aggregation({"w": (3,)}, l2_norm_clip=math.inf,
                                  privacy=Privacy("l", 1e-5, noise_multiplier=1.0))


# Adaptive clipping against TF Privacy ------------------------------------------------------------
GOLDEN_CASES = json.loads(GOLDEN.read_text())["cases"]


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=[c["name"] for c in GOLDEN_CASES])
def test_adaptive_bound_and_sums_follow_tf_privacy(client, case):
    """QuantileAdaptiveClipSumQuery with noise off: the same bound every round, the same sums, the same update."""
    m, d = case["expected_num_records"], case["dimension"]
    privacy = Privacy(ledger_name(), 1e-5, noise_multiplier=0.0, public_denominator=float(m), adaptive=Adaptive(
        target_unclipped_quantile=case["target_unclipped_quantile"], learning_rate=case["learning_rate"],
        initial_bound=case["initial_l2_norm_clip"], arithmetic_update=not case["geometric_update"]))
    for t, golden in enumerate(case["rounds"][:100]):  # from 0.1 or 10, the bound reaches 1 within ~25 rounds
        agg = client.create_aggregation({"x": (d,)}, l2_norm_clip=1.0, privacy=privacy)
        assert client.get_aggregation(agg).layer_bounds[0] == pytest.approx(golden["clip"], rel=2e-5), t
        client.submit(agg, {"x": np.asarray(golden["records"], np.float32)})
        result = client.finalize(agg)
        client.cancel(agg)
        release = result.release
        np.testing.assert_allclose(result.sums["x"], golden["sum"], rtol=1e-4, atol=1e-5 * golden["clip"])
        assert release.bound == pytest.approx(golden["clip"], rel=2e-5)
        assert release.unclipped_fraction == pytest.approx(golden["unclipped_fraction"], abs=1e-6)
        assert release.next_bound == pytest.approx(golden["next_clip"], rel=2e-5)
    if case["name"].startswith("median"):
        assert 0.5 < release.next_bound < 2.0  # converged near the median norm, 1


# Statistics that don't leak ---------------------------------------------------------------------
def _raw_numbers_visible(client, agg) -> list[str]:
    """Every route that could show a raw statistic of ``agg``; the names of those that do."""
    leaks = []
    stats = client.stats(agg)
    if stats.examples or stats.batches or stats.bytes or stats.clipped or list(stats.example_norm_histogram) or any(
            layer.clipped or layer.norm_max or layer.norm_mean or list(layer.norm_histogram) for layer in stats.layers):
        leaks.append("GetStats")
    if client.get_aggregation(agg).examples:
        leaks.append("GetAggregation")
    if any(a.examples for a in client.list_aggregations() if a.aggregation_id == agg):
        leaks.append("ListAggregations")
    return leaks


def _private_metric_lines(metrics: str, aggregation: str) -> list[str]:
    """The names of the Prometheus series that carry this aggregation's label."""
    return sorted({line.split("{")[0] for line in metrics.splitlines()
                   if not line.startswith("#") and f'aggregation="{aggregation}"' in line})


def test_no_raw_statistic_is_reachable_under_a_privacy_policy(private_server):
    server, client, base = private_server
    privacy = Privacy(ledger_name(), 1e-5, noise_multiplier=1.0, metrics_noise_multiplier=2.0)
    agg = client.create_aggregation({"w": (8,)}, l2_norm_clip=0.5, privacy=privacy)
    report = client.submit(agg, {"w": np.full((6, 8), 3.0, np.float32)})
    assert report.batches >= 1
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:  # acknowledgements: no count
        from clipd.v1 import clipd_pb2_grpc as pb_grpc

        responses = list(pb_grpc.ClipdStub(channel).Submit(iter([pb.SubmitRequest(
            aggregation_id=agg, client_id="probe", sequence=0, writer_id="w")])))
        assert responses and all(r.aggregation_examples == 0 for r in responses)
    assert _raw_numbers_visible(client, agg) == []
    assert "withheld" in client.stats(agg).privacy_notice
    view = httpx.get(f"{base}/api/v1/aggregations/{agg}").json()
    assert view["examples"] is None and view["clipped"] is None and view["example_norm_histogram"] is None
    assert set(view["layers"][0]) == {"name", "shape", "dtype", "bound"}
    assert _private_metric_lines(httpx.get(f"{base}/metrics").text, agg) == ["clipd_layer_bound", "clipd_privacy_debug"]
    result = client.finalize(agg)
    assert result.examples == 0 and result.clip_counts == {"w": 0}  # the raw ones stay withheld
    released = result.release
    assert len(released.layer_clipped) == 1 and len(released.example_norm_histogram) > 0
    assert released.statistics_noise_stddev == pytest.approx(2.0 * math.sqrt(3))
    assert _raw_numbers_visible(client, agg) == []
    view = httpx.get(f"{base}/api/v1/aggregations/{agg}").json()
    assert view["examples"] is None and view["privacy"]["release"]["examples"] == released.examples
    ledger_view = httpx.get(f"{base}/api/v1/ledgers/{privacy.ledger_id}").json()
    assert ledger_view["epsilon"] == pytest.approx(released.ledger_epsilon) and len(ledger_view["entries"]) == 1
    assert httpx.get(f"{base}/api/v1/ledgers/no-such-ledger").status_code == 404
    with pytest.raises(NotFoundError):
        client.ledger("no-such-ledger")
    metrics = httpx.get(f"{base}/metrics").text
    assert _private_metric_lines(metrics, agg) == ["clipd_layer_bound", "clipd_privacy_debug", "clipd_release_noise_stddev",
                                                   "clipd_released_clipped", "clipd_released_examples"]
    assert f'clipd_ledger_epsilon{{ledger="{privacy.ledger_id}"}}' in metrics


def test_debug_mode_shows_raw_statistics_and_makes_epsilon_infinite(private_server):
    server, client, base = private_server
    ledger = ledger_name()
    with pytest.raises(FailedPreconditionError, match="exhausted"):  # a budget can't pay for raw statistics
        client.create_aggregation({"w": (8,)}, privacy=Privacy(ledger_name(), 1e-5, noise_multiplier=1.0,
                                                                max_epsilon=100.0, debug_raw_statistics=True))
    privacy = Privacy(ledger, 1e-5, noise_multiplier=1.0, debug_raw_statistics=True)
    agg = client.create_aggregation({"w": (8,)}, l2_norm_clip=0.5, privacy=privacy)
    client.submit(agg, {"w": np.full((6, 8), 3.0, np.float32)})
    stats = client.stats(agg)
    assert stats.examples == 6 and stats.layers[0].clipped == 6
    assert stats.privacy_notice.startswith("DEBUG") and "infinite" in stats.privacy_notice
    ledger_now = client.ledger(ledger)
    assert math.isinf(ledger_now.epsilon) and ledger_now.debug_raw_statistics
    assert json.loads(ledger_now.entries[0].dp_event_json)["class_name"] == "NonPrivateDpEvent"
    listing = httpx.get(f"{base}/api/v1/aggregations").json()
    assert listing["privacy_debug_notice"].startswith("DEBUG MODE") and ledger in listing["privacy_debug_notice"]
    assert math.isinf(client.finalize(agg).release.ledger_epsilon)
    client.cancel(agg)


@pytest.fixture(scope="module")
def private_server(tmp_path_factory):
    """A server with its admin API (auth off, loopback) and a client."""
    from conftest import TEST_SETTINGS

    from clipd.client import Client
    from clipd.server.app import create_server
    from clipd.server.settings import Settings

    data_dir = tmp_path_factory.mktemp("clipd-private")
    server, _ = create_server(Settings(**{**TEST_SETTINGS, "data_dir": str(data_dir), "admin_port": 0}))
    with Client(f"127.0.0.1:{server.port}") as client:
        yield server, client, f"http://127.0.0.1:{server.admin.port}"
    server.stop(grace=1.0)


def test_a_release_stored_in_the_format_before_the_container_still_reads_and_damage_is_refused():
    """Releases are kept in the container format of checkpoints now (magic CLIPDRL2); one a store kept in the
    older format (CLIPDREL1, built here byte by byte as that format was written) reads back the same."""
    import json
    import zlib

    from clipd.engine import CorruptStateError
    from clipd.server.privacy import Release

    fields, sums = {"epsilon": 0.75, "noise_stddev": 2.0}, (np.array([[1.5, -2.0]]), np.array([3.25]))
    header = json.dumps({"fields": fields, "arrays": [[list(a.shape), a.dtype.str] for a in sums]}).encode()
    blob = b"CLIPDREL1\n" + len(header).to_bytes(8, "little") + header + b"".join(a.tobytes() for a in sums)
    legacy = blob + zlib.crc32(blob).to_bytes(4, "little")
    for stored in (legacy, Release(fields, sums).to_bytes()):
        release = Release.from_bytes(stored)
        assert release.fields == fields
        assert [a.tolist() for a in release.sums] == [[[1.5, -2.0]], [3.25]]
        damaged = bytearray(stored)
        damaged[-6] ^= 1
        with pytest.raises(CorruptStateError):
            Release.from_bytes(bytes(damaged))
    assert Release(fields, sums).to_bytes()[:8] == b"CLIPDRL2"


def test_the_written_out_non_private_entry_is_dp_accountings():
    """clipd.server.privacy writes NON_PRIVATE out (its import does not load dp_accounting): the same text as
    the NonPrivateDpEvent serialized as every other ledger entry, and read back as that event."""
    from clipd.engine import _privacy as dp
    from clipd.server.privacy import NON_PRIVATE

    assert NON_PRIVATE == dp.event_to_json(dpe.NonPrivateDpEvent())
    assert dp.event_from_json(NON_PRIVATE) == dpe.NonPrivateDpEvent()


IMPORTS = ("import sys, clipd.server.app, clipd.server.shards.host, clipd.engine._privacy as dp; "
           "print(sorted({m.split('.')[0] for m in sys.modules} & {'dp_accounting', 'scipy'})); "
           "dp.epsilon_of_json(['{\"class_name\": \"GaussianDpEvent\", \"module_name\": \"dp_accounting.dp_event\","
           " \"noise_multiplier\": 1.0}'], 1e-5, dp.Accountant.RDP, dp.Neighbouring.ADD_REMOVE_ONE); "
           "print('dp_accounting' in sys.modules)")


def _imports_job() -> background.Job:
    return background.Job("privacy:imports", functools.partial(background.run_process,
                                                               [sys.executable, "-c", IMPORTS], 120))


WARM_UP = """
import os, sys, tempfile, threading
import clipd.engine._privacy as dp
from clipd.client import Client
from clipd.server.app import create_server
from clipd.server.settings import Settings
def serve(warm, data_dir="memory"):
    server, port = create_server(Settings(host="127.0.0.1", grpc_port=0, admin_port=-1, data_dir=data_dir,
                                          warm_privacy=warm))
    for thread in threading.enumerate():
        if thread.name == "clipd-privacy-warm-up":
            thread.join(120)
    return server, port
seen = []
server, _ = serve(False)
seen += ["dp_accounting" in sys.modules, "scipy" in sys.modules, dp._release_keys._cache_size()]
server.stop(grace=0)
with tempfile.TemporaryDirectory() as data_dir:  # a restart with an open aggregation to finish: no warm-up
    server, port = serve(False, data_dir)
    with Client(f"127.0.0.1:{port}") as client:
        client.create_aggregation({"w": (3,)}, l2_norm_clip=1.0)
    server.stop(grace=0)
    server, _ = serve(True, data_dir)
    seen.append("dp_accounting" in sys.modules)
    server.stop(grace=0)
server, _ = serve(True)
seen += ["dp_accounting" in sys.modules, "scipy" in sys.modules, dp._release_keys._cache_size()]
server.stop(grace=0)
print(*seen, flush=True)
os._exit(0)  # (not gRPC's teardown at the interpreter's exit)
"""


def _warm_up_job() -> background.Job:
    return background.Job("privacy:warm-up", functools.partial(background.run_process,
                                                               [sys.executable, "-c", WARM_UP], 120))


def background_jobs(items, config) -> list[background.Job]:
    """The fresh interpreters of the import and warm-up tests start once the tests are collected
    (tests/background.py)."""
    names = {item.originalname for item in items}
    return ([_imports_job()] if "test_a_server_without_privacy_does_not_import_dp_accounting" in names else []) + (
        [_warm_up_job()] if "test_a_serving_server_loads_the_accountant_before_its_first_private_release" in names
        else [])


def test_a_server_without_privacy_does_not_import_dp_accounting():
    """dp_accounting and the scipy it loads (most of a server process's start-up) come with the first privacy
    policy: the server, a shard process and the engine import neither; the accounting loads them when asked
    (in a fresh interpreter)."""
    out = background.job("privacy:imports", _imports_job).result()
    assert out.returncode == 0 and out.stdout.split() == ["[]", "True"], out.stdout + out.stderr


def test_a_serving_server_loads_the_accountant_before_its_first_private_release():
    """warm_privacy (the default): once serving, a thread loads dp_accounting (and scipy) and compiles the release
    keys' program (seeded and fresh), so that a trainer's first step does not wait for them; off, neither is
    loaded until used; on, but restarted with an open aggregation to finish, not either (its clients' streams
    come first). In a fresh interpreter: off, a restart with an open aggregation, then on."""
    out = background.job("privacy:warm-up", _warm_up_job).result()
    assert out.returncode == 0 and out.stdout.split() == ["False", "False", "0", "False", "True", "True", "2"], \
        out.stdout + out.stderr
