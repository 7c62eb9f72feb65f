"""clipd's ledger against Flower's own privacy code (flwr 1.41.0): RdpAccountant, would_exceed, compute_stdv,
compute_adaptive_noise_params. The releases are made by a real clipd server; Flower computes the oracles."""

from __future__ import annotations

import uuid

import pytest
from flwr.supercore.differential_privacy import compute_adaptive_noise_params, compute_stdv
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

from clipd.client import Adaptive, FailedPreconditionError, Privacy


def _ledger() -> str:
    return f"flower-{uuid.uuid4().hex[:10]}"


def _release(client, privacy, clip=1.0):
    agg = client.create_aggregation({"w": (4,)}, l2_norm_clip=clip, privacy=privacy)
    release = client.finalize(agg).release
    client.cancel(agg)
    return release


@pytest.mark.parametrize("sampling, relation", [
    (SamplingMethod.POISSON, NeighboringRelation.ADD_OR_REMOVE_ONE),
    (SamplingMethod.WITHOUT_REPLACEMENT, NeighboringRelation.REPLACE_ONE),
])
def test_ledger_epsilon_equals_flowers_rdp_accountant(client, sampling, relation):
    population, sampled, z, delta = 1000, 20, 1.1, 1e-5
    flower = RdpAccountant(PrivacyConfig(target_delta=delta, population_size=population,
                                         neighboring_relation=relation, sampling_method=sampling))
    event = GaussianPrivacyEvent(noise_multiplier=z, sample_size=sampled, population_size=population)
    if sampling is SamplingMethod.POISSON:
        privacy = Privacy(_ledger(), delta, noise_multiplier=z, sampling="poisson", sampling_rate=sampled / population)
    else:
        privacy = Privacy(_ledger(), delta, noise_multiplier=z, sampling="fixed_size", population=population,
                          sample_size=sampled, neighbouring="replace_one")
    for _ in range(3):
        release = _release(client, privacy)
        flower.compose(event)
        assert release.ledger_epsilon == pytest.approx(flower.get_epsilon(delta), rel=1e-6)


def test_budget_refusal_matches_flowers_would_exceed(client):
    population, sampled, z, delta, budget = 100, 10, 1.5, 1e-5, 1.3  # the 6th release does not fit
    flower = RdpAccountant(PrivacyConfig(target_delta=delta, population_size=population,
                                         neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                         sampling_method=SamplingMethod.POISSON, max_epsilon=budget))
    event = GaussianPrivacyEvent(noise_multiplier=z, sample_size=sampled, population_size=population)
    privacy = Privacy(_ledger(), delta, noise_multiplier=z, sampling="poisson", sampling_rate=sampled / population,
                      max_epsilon=budget)
    decisions = []
    for _ in range(40):
        flower_refuses = flower.would_exceed(event)
        try:
            _release(client, privacy)
            clipd_refuses = False
            flower.compose(event)
        except FailedPreconditionError:
            clipd_refuses = True
        decisions.append((flower_refuses, clipd_refuses))
        if clipd_refuses:
            break
    assert all(f == c for f, c in decisions), decisions
    assert decisions[-1] == (True, True) and len(decisions) > 2


def test_noise_stddev_is_flowers_compute_stdv_times_m(client):
    z, clip, m = 1.3, 0.8, 25
    release = _release(client, Privacy(_ledger(), 1e-5, noise_multiplier=z), clip=clip)
    assert release.noise_stddev == pytest.approx(compute_stdv(z, clip, m) * m, rel=1e-12)


def test_noise_split_is_flowers_compute_adaptive_noise_params(client):
    z, m, sigma_b = 1.0, 40, 2.0
    _, z_v = compute_adaptive_noise_params(z, m, sigma_b)
    privacy = Privacy(_ledger(), 1e-5, noise_multiplier=z, public_denominator=m,
                      adaptive=Adaptive(count_stddev=sigma_b, initial_bound=1.0))
    assert _release(client, privacy).value_noise_multiplier == pytest.approx(z_v, rel=1e-12)
