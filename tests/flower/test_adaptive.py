"""Adaptive clipping on data whose median update norm is 1: Flower's server-side wrapper runs away, clipd converges.

Flower 1.41's ``DifferentialPrivacyServerSideAdaptiveClipping`` feeds the CLIPPED fraction into Andrew
et al.'s rule ``C *= exp(-lr * (fraction - target))``, which expects the UNCLIPPED fraction: too small a
bound clips everything and shrinks further, too large a bound clips nothing and grows further
(DP.md, "Adaptive clipping"). clipd's server applies the rule to the noised unclipped fraction and
carries the bound on the ledger from one round's aggregation to the next, so ClipdStrategy's bound
converges to the median norm; the trajectory is TF Privacy's ``QuantileAdaptiveClipSumQuery`` (the
golden file's ``clip`` per round, generated from the real library by tests/golden/make_tf_privacy_adaptive.py).

Both are driven with noise off (z = 0, count noise 0), so the trajectories are deterministic.
"""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
from flower_helpers import ROOT, FixedGrid, reply
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import DifferentialPrivacyServerSideAdaptiveClipping, FedAvg

from clipd.client import Adaptive, Privacy
from clipd.client.flower import ClipdStrategy

GOLDEN = ROOT / "tests" / "golden" / "tf_privacy_adaptive.json"
ROUNDS = 45  # of the golden file's 200: TF Privacy's trajectory is within 15 % of 1 from round 30 on
LEARNING_RATE, TARGET = 0.2, 0.5


def _case(name: str, initial: float) -> dict:
    """Rounds of records (m records per round, median norm 1): the golden file's, or seeded ones like them."""
    if GOLDEN.exists():
        case = next(c for c in json.loads(GOLDEN.read_text())["cases"] if c["name"] == name)
        assert (case["initial_l2_norm_clip"], case["learning_rate"], case["target_unclipped_quantile"]) == (
            initial, LEARNING_RATE, TARGET) and case["geometric_update"]
        rounds = case["rounds"][:ROUNDS]
        return {"m": case["expected_num_records"], "initial": initial,
                "records": [np.asarray(r["records"], np.float32) for r in rounds],
                "tf_clips": [r["clip"] for r in rounds]}
    rng = np.random.default_rng(20210001 if name == "median_from_small" else 20210002)
    records = []
    for _ in range(ROUNDS):
        directions = rng.standard_normal((10, 3))
        norms = np.exp(rng.normal(0.0, 0.5, 10))  # median 1
        records.append((directions / np.linalg.norm(directions, axis=1, keepdims=True) * norms[:, None])
                       .astype(np.float32))
    return {"m": 10, "initial": initial, "records": records, "tf_clips": None}


def _flower_bounds(case: dict) -> list[float]:
    """The bound of each round of Flower's own wrapper, fed the same replies."""
    strategy = DifferentialPrivacyServerSideAdaptiveClipping(
        FedAvg(), noise_multiplier=0.0, num_sampled_clients=case["m"], initial_clipping_norm=case["initial"],
        target_clipped_quantile=TARGET, clip_norm_lr=LEARNING_RATE, clipped_count_stddev=0.0)
    zero = [np.zeros(3, np.float32)]
    bounds = []
    for t, records in enumerate(case["records"], start=1):
        strategy.current_arrays = ArrayRecord(zero)  # what its configure_train records
        bounds.append(strategy.clipping_norm)
        strategy.aggregate_train(t, [reply(1001 + i, [r]) for i, r in enumerate(records)])
    return bounds


def _clipd_bounds(client, case: dict) -> list[float]:
    """The bound of each round of ClipdStrategy (the release's ``bound``), fed the same updates."""
    m = case["m"]
    privacy = Privacy(ledger_id=f"adaptive-{uuid.uuid4().hex[:12]}", delta=1e-5, noise_multiplier=0.0,
                      adaptive=Adaptive(target_unclipped_quantile=TARGET, learning_rate=LEARNING_RATE,
                                        count_stddev=0.0, initial_bound=case["initial"]))
    strategy = ClipdStrategy(FedAvg(min_train_nodes=m, min_available_nodes=m, fraction_evaluate=0.0), client,
                             num_sampled_clients=m, privacy=privacy)
    zero = ArrayRecord([np.zeros(3, np.float32)])  # the model stays at 0: each update is the record itself
    for t, records in enumerate(case["records"], start=1):
        messages = list(strategy.configure_train(t, zero, ConfigRecord(), FixedGrid(m)))
        nodes = [message.metadata.dst_node_id for message in messages]
        arrays, _ = strategy.aggregate_train(t, [reply(n, [r]) for n, r in zip(nodes, records)])
        assert arrays is not None, strategy.stopped
    ledger = client.ledger(privacy.ledger_id)
    assert len(ledger.entries) == len(case["records"])
    assert ledger.next_bound == pytest.approx(strategy.clipping_norm)
    return [release.bound for release in strategy.releases]


@pytest.mark.parametrize("name, initial", [("median_from_small", 0.1), ("median_from_large", 10.0)])
def test_flower_runs_away_while_clipd_converges_to_the_median_norm(client, name, initial):
    case = _case(name, initial)
    norms = np.linalg.norm(np.concatenate(case["records"]), axis=1)
    assert 0.9 < np.median(norms) < 1.1

    flower = _flower_bounds(case)
    ours = _clipd_bounds(client, case)

    if initial < 1:  # everything clipped: Flower shrinks the bound by exp(-0.1) a round, for ever
        assert flower[-1] < initial * np.exp(-0.09 * (ROUNDS - 1)) < 0.01
    else:  # nothing clipped: it grows by exp(0.1) a round
        assert flower[-1] > initial * np.exp(0.09 * (ROUNDS - 1)) > 100
    settled = ours[-15:]
    assert all(0.75 < c < 1.33 for c in settled), settled
    if case["tf_clips"] is not None:  # the real TF Privacy query's trajectory, round by round
        np.testing.assert_allclose(ours, case["tf_clips"], rtol=1e-4)
