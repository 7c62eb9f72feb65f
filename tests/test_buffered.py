"""Buffered asynchronous aggregation's math (engine/_buffered.py): FedBuff's staleness weights; and what a client
limited to k contributions b releases apart costs under independent noise (engine/_privacy.py), against
dp_accounting."""

from __future__ import annotations

import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant

from clipd.engine import _buffered as buffered
from clipd.engine import _privacy as dp


@pytest.mark.parametrize("tau, exponent, expected", [(0, 0.5, 1.0), (3, 0.5, 0.5), (8, 0.5, 1 / 3), (1, 2.0, 0.25),
                                                     (5, 0.0, 1.0)])
def test_the_staleness_weight_is_fedbuffs_polynomial(tau, exponent, expected):
    """(1 + tau)^-a, worked by hand: 4^-0.5 = 1/2, 9^-0.5 = 1/3, 2^-2 = 1/4."""
    assert buffered.staleness_weight(tau, exponent) == pytest.approx(expected, rel=1e-12)


def test_staleness_counts_the_versions_released_in_between_and_refuses_the_future():
    assert buffered.staleness(released=1, trained_from=0) == 0  # trained from the model before the first release
    assert buffered.staleness(released=10, trained_from=6) == 3
    with pytest.raises(ValueError, match="can't land"):
        buffered.staleness(released=4, trained_from=4)
    with pytest.raises(ValueError, match=">= 0"):
        buffered.staleness_weight(1, -0.5)


@pytest.mark.parametrize("releases, b, k", [(100, 10, 3), (20, 10, 5), (7, 1, 7), (50, 4, 20)])
def test_a_clients_epsilon_is_dp_accountings_for_its_participations(releases, b, k):
    """k' = the most releases a client can be in (positions 0, b, 2b, ... below n, at most k, counted here by
    walking them); a participation-limited ledger's entry after n releases is dp_accounting's k' Gaussian
    releases of multiplier z."""
    most = len([t for t in range(0, releases, b)][:k])
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dpe.GaussianDpEvent(1.5), most)
    entry = dp.participation_event(dp.event_to_json(dpe.GaussianDpEvent(1.5)), releases, dp.Participation(b, k))
    assert dp.epsilon_of_json([entry], 1e-5, "rdp", "add_remove_one") == pytest.approx(accountant.get_epsilon(1e-5),
                                                                                       rel=1e-9)


def test_an_events_json_is_remembered_only_for_the_same_event_as_written():
    """The JSON of an event is made once (dp_accounting makes a class per ``to_named_tuple``), yet an event equal
    to another but written otherwise (1 == 1.0) keeps its own text, which a ledger's configuration compares."""
    import json

    for event in (dpe.GaussianDpEvent(1), dpe.GaussianDpEvent(1.0),
                  dpe.SelfComposedDpEvent(dpe.GaussianDpEvent(2.0), 3)):
        assert json.loads(dp.event_to_json(event)) == json.loads(json.dumps(dp._plain(event.to_named_tuple())))
    assert dp.event_to_json(dpe.GaussianDpEvent(1)) != dp.event_to_json(dpe.GaussianDpEvent(1.0))
