"""ClipdStrategy against Flower's own DP wrapper (the oracle), and the cases where that wrapper breaks.

The oracle is flwr 1.41's ``DifferentialPrivacyServerSideFixedClipping`` over ``FedAvg`` with equal
weights: with z = 0 and every sampled client replying, both release the mean of the clipped updates
around the current model, so they must agree to float32 rounding.
"""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest
from flower_helpers import FixedGrid, error_reply, reply
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

from clipd.client import Adaptive, Privacy
from clipd.client.flower import ClipdStrategy

SHAPES = [(6, 4), (4,), (3, 2, 2)]
C = 1.0


def _model(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]


def _updates(m: int, seed: int = 1) -> list[list[np.ndarray]]:
    """Updates whose global norms spread from 0.2 to 5 around C, so some are clipped and some not."""
    rng = np.random.default_rng(seed)
    out = []
    for norm in np.geomspace(0.2, 5.0, m):
        parts = [rng.standard_normal(shape) for shape in SHAPES]
        total = math.sqrt(sum(float(np.sum(p * p)) for p in parts))
        out.append([(p * norm / total).astype(np.float32) for p in parts])
    return out


def _plus(model: list[np.ndarray], update: list[np.ndarray]) -> list[np.ndarray]:
    return [w + u for w, u in zip(model, update)]


def _privacy(**overrides) -> Privacy:
    return Privacy(**{"ledger_id": f"flower-test-{uuid.uuid4().hex[:12]}", "delta": 1e-5, "noise_multiplier": 0.0,
                      **overrides})


def _strategy(client, m: int, **kwargs) -> ClipdStrategy:
    inner = FedAvg(min_train_nodes=m, min_available_nodes=m, fraction_evaluate=0.0)
    return ClipdStrategy(inner, client, num_sampled_clients=m, **{"clipping_norm": C, **kwargs})


def _round(strategy: ClipdStrategy, model: list[np.ndarray], replies_of, server_round: int = 1, nodes: int = 0):
    """configure_train on a grid of ``nodes`` (default m) nodes, then aggregate_train on ``replies_of(nodes)``."""
    grid = FixedGrid(nodes or int(strategy.num_sampled_clients))
    messages = list(strategy.configure_train(server_round, ArrayRecord(model), ConfigRecord(), grid))
    return messages, strategy.aggregate_train(server_round, replies_of([m.metadata.dst_node_id for m in messages]))


def _flower_oracle(model, updates, m, replies=None):
    flower = DifferentialPrivacyServerSideFixedClipping(FedAvg(), noise_multiplier=0.0, clipping_norm=C,
                                                         num_sampled_clients=m)
    flower.current_arrays = ArrayRecord(model)  # what its configure_train records
    replies = replies or [reply(1001 + i, [w + u for w, u in zip(model, update)]) for i, update in enumerate(updates)]
    arrays, _ = flower.aggregate_train(1, replies)
    return arrays.to_numpy_ndarrays()


@pytest.mark.parametrize("private, mean", [(True, False), (True, True), (False, False)],
                         ids=["privacy-z0", "privacy-z0-release-mean", "no-privacy"])
def test_equals_flowers_fixed_clipping_wrapper_with_z_0(client, private, mean):
    m = 8
    model, updates = _model(), _updates(m)
    expected = _flower_oracle(model, updates, m)
    strategy = _strategy(client, m, privacy=_privacy(release_mean=mean) if private else None)
    messages, (arrays, metrics) = _round(
        strategy, model, lambda nodes: [reply(n, _plus(model, updates[i])) for i, n in enumerate(nodes)])
    assert len(messages) == m
    got = arrays.to_numpy_ndarrays()
    assert [a.dtype for a in got] == [np.float32] * len(SHAPES)
    for ours, theirs in zip(got, expected):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    # some updates were clipped, some not: the comparison covers both
    norms = [math.sqrt(sum(float(np.sum(u * u)) for u in update)) for update in updates]
    assert min(norms) < C < max(norms)
    if private:
        assert metrics["noise-stddev"] == 0.0 and metrics["bound"] == C and math.isinf(metrics["epsilon"])
        assert strategy.releases[-1].mean == mean  # the server divided by m: the strategy must not again
    else:
        assert dict(metrics) == {"bound": C}


def test_zero_and_nan_updates_do_not_crash_and_nan_contributes_zero(client):
    m = 4
    model, updates = _model(2), _updates(m, seed=3)
    updates[1] = [np.zeros(shape, np.float32) for shape in SHAPES]  # a client that did not move the model
    poisoned = [u.copy() for u in updates[2]]
    poisoned[0][0, 0] = np.nan  # a client whose training diverged
    poisoned[1][0] = np.inf
    sent = [updates[0], updates[1], poisoned, updates[3]]

    def replies(nodes):
        return [reply(n, [w + u for w, u in zip(model, sent[i])]) for i, n in enumerate(nodes)]

    # Flower's wrapper: ZeroDivisionError on the zero update (C / 0.0 in Python floats) ...
    with pytest.raises(ZeroDivisionError):
        _flower_oracle(model, None, m, replies=replies(range(1001, 1001 + m)))
    # ... and, without it, the NaN update goes through unclipped into the average.
    flower = _flower_oracle(model, None, m, replies=[r for i, r in enumerate(replies(range(1001, 1001 + m))) if i != 1])
    assert np.isnan(flower[0]).any()

    strategy = _strategy(client, m, privacy=_privacy())
    _, (arrays, _) = _round(strategy, model, replies)
    got = arrays.to_numpy_ndarrays()
    assert all(np.isfinite(a).all() for a in got)
    # The oracle on the two other updates; the zero one and the zeroed NaN one add nothing but count in m.
    # (Flower's wrapper can't take the zero update: its mean over those 2 is rescaled to m = 4 clients.)
    finite = [reply(1001 + i, [w + u for w, u in zip(model, sent[i])]) for i in (0, 3)]
    expected = [w + (o - w) * 2 / m for o, w in zip(_flower_oracle(model, None, 2, finite), model)]
    for ours, theirs in zip(got, expected):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_dropouts_and_errors_still_divide_by_the_public_denominator(client):
    m = 5
    model, updates = _model(4), _updates(m, seed=5)

    def replies(nodes):  # node 2 never answers, node 4 answers with an error
        return [reply(n, [w + u for w, u in zip(model, updates[i])]) for i, n in enumerate(nodes) if i not in (2, 4)] \
            + [error_reply(nodes[4])]

    strategy = _strategy(client, m, privacy=_privacy())
    _, (arrays, _) = _round(strategy, model, replies)
    kept = [0, 1, 3]
    expected = _flower_oracle(model, [updates[i] for i in kept], len(kept))  # the mean over the 3 that arrived
    for ours, theirs, w in zip(arrays.to_numpy_ndarrays(), expected, model):
        np.testing.assert_allclose(ours, w + (theirs - w) * len(kept) / m, rtol=1e-5, atol=1e-6)


def test_replies_without_the_models_arrays_contribute_nothing(client):
    m = 3
    model, updates = _model(6), _updates(m, seed=7)

    def replies(nodes):
        good = [reply(nodes[0], [w + u for w, u in zip(model, updates[0])])]
        wrong_shape = reply(nodes[1], [np.ones((2, 2), np.float32), model[1], model[2]])
        wrong_keys = reply(nodes[2], {"other": np.ones(3, np.float32)})
        return good + [wrong_shape, wrong_keys]

    strategy = _strategy(client, m, privacy=_privacy())
    _, (arrays, _) = _round(strategy, model, replies)
    expected = _flower_oracle(model, [updates[0]], 1)
    for ours, theirs, w in zip(arrays.to_numpy_ndarrays(), expected, model):
        np.testing.assert_allclose(ours, w + (theirs - w) / m, rtol=1e-5, atol=1e-6)


def test_noise_is_the_servers_release_divided_by_m_and_metrics_are_private(client):
    m = 4
    rng = np.random.default_rng(8)
    model = [np.zeros(20000, np.float32), np.zeros(3, np.float32)]
    updates = [[rng.standard_normal(20000).astype(np.float32) * 0.001, np.zeros(3, np.float32)] for _ in range(m)]
    z = 2.0
    strategy = _strategy(client, m, privacy=_privacy(noise_multiplier=z, metrics_noise_multiplier=5.0))
    _, (arrays, metrics) = _round(
        strategy, model, lambda nodes: [reply(n, _plus(model, updates[i])) for i, n in enumerate(nodes)])
    noise = arrays.to_numpy_ndarrays()[0] - sum(u[0] for u in updates) / m
    release = strategy.releases[-1]
    assert release.noise_stddev > 0
    assert metrics["noise-stddev-of-mean"] == pytest.approx(release.noise_stddev / m)
    assert np.std(noise) == pytest.approx(release.noise_stddev / m, rel=0.05)  # 20000 draws: ~0.5 % error
    assert 0 < metrics["epsilon"] == metrics["ledger-epsilon"] < math.inf
    assert {"epsilon", "ledger-epsilon", "delta", "noise-stddev", "bound", "next-bound", "examples",
            "layer-clipped", "norm-histogram", "statistics-noise-stddev"} <= set(metrics)
    assert metrics["examples"] != m  # the released count is noised (stddev 5 * 1/2)
    assert not {"num-examples", "clipped", "non-finite"} & set(metrics)


def test_a_refused_release_stops_training_cleanly(client):
    m = 3
    model, updates = _model(9), _updates(m, seed=10)
    probe = _strategy(client, m, privacy=_privacy(noise_multiplier=1.0))
    _round(probe, model, lambda nodes: [])
    one_release = probe.releases[-1].epsilon  # epsilon of one such release on a fresh ledger

    strategy = _strategy(client, m, privacy=_privacy(noise_multiplier=1.0, max_epsilon=1.2 * one_release))

    def replies(nodes):
        return [reply(n, [w + u for w, u in zip(model, updates[i])]) for i, n in enumerate(nodes)]

    messages, (arrays, metrics) = _round(strategy, model, replies, server_round=1)
    assert len(messages) == m and arrays is not None and strategy.stopped is None
    assert metrics["budget-left"] == pytest.approx(0.2 * one_release, rel=1e-6)
    messages, (arrays, metrics) = _round(strategy, model, replies, server_round=2)  # can't afford a second
    assert messages == [] and (arrays, metrics) == (None, None)
    assert "budget" in strategy.stopped and "exhausted" in strategy.stopped
    messages, result = _round(strategy, model, replies, server_round=3)
    assert messages == [] and result == (None, None)
    assert client.ledger(strategy.privacy.ledger_id).entries.__len__() == 1


def test_public_denominator_is_m():
    with pytest.raises(ValueError, match="public_denominator"):
        ClipdStrategy(FedAvg(), None, clipping_norm=1.0, num_sampled_clients=10,
                      privacy=_privacy(public_denominator=7.0))
    strategy = ClipdStrategy(FedAvg(), None, clipping_norm=1.0, num_sampled_clients=10, privacy=_privacy())
    assert strategy.privacy.public_denominator == 10.0
    with pytest.raises(ValueError, match="adaptive"):
        ClipdStrategy(FedAvg(), None, clipping_norm=1.0, num_sampled_clients=10,
                      privacy=_privacy(adaptive=Adaptive(initial_bound=0.5)))
    adaptive = ClipdStrategy(FedAvg(), None, num_sampled_clients=10,
                             privacy=_privacy(adaptive=Adaptive(initial_bound=0.5)))
    assert adaptive.clipping_norm == 0.5


def test_a_round_with_secure_noise(client):
    """The strategy takes the secure noise as any policy: the server's grid release, divided by m; the deviation
    from Flower's noiseless wrapper is that release's noise over m, of the stated scale (z C widened by < 0.2%)."""
    m, z = 8, 2.0
    model, updates = _model(4), _updates(m, seed=5)
    expected = _flower_oracle(model, updates, m)
    strategy = _strategy(client, m, privacy=_privacy(noise_multiplier=z, noise="secure", accountant="zcdp"))
    _, (arrays, metrics) = _round(
        strategy, model, lambda nodes: [reply(n, _plus(model, updates[i])) for i, n in enumerate(nodes)])
    release = strategy.releases[-1]
    assert release.grid_step > 0 and release.grid_noise_scale > 0 and not release.seeded
    assert z * C < metrics["noise-stddev"] == release.noise_stddev < z * C * 1.002
    assert math.isfinite(metrics["epsilon"]) and metrics["epsilon"] > 0
    noise = np.concatenate([(ours - theirs).ravel() for ours, theirs in zip(arrays.to_numpy_ndarrays(), expected)])
    assert 0.5 < np.std(noise * m / release.noise_stddev) < 1.6  # 40 draws: a loose check of the scale


def test_rounds_on_a_correlated_stream_enforce_each_nodes_participation(client):
    """mechanism="banded", n = 3 rounds, b = 2, k = 2, z = 0: round 1 is Flower's noiseless mean; in round 2 the
    same nodes took part one round ago: each is refused and the model stays as it was; round 3 takes them
    again. The rounds are the stream's releases 0, 1, 2. (The server enforces participation the same way
    whatever the stream's mechanism; a BLT stream's own releases are tests/test_correlated_service.py's.)"""
    m = 4
    model, updates = _model(6), _updates(m, seed=7)
    strategy = _strategy(client, m, privacy=_privacy(mechanism="banded", releases=3, min_separation=2,
                                                     max_participations=2))

    def replies(nodes):
        return [reply(n, _plus(model, updates[i])) for i, n in enumerate(nodes)]

    _, (first, metrics) = _round(strategy, model, replies, server_round=1)
    for ours, theirs in zip(first.to_numpy_ndarrays(), _flower_oracle(model, updates, m)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    _, (second, _) = _round(strategy, model, replies, server_round=2)
    for ours, before in zip(second.to_numpy_ndarrays(), model):
        np.testing.assert_array_equal(ours, before)  # every node refused: nothing summed, no noise (z = 0)
    _, (third, _) = _round(strategy, model, replies, server_round=3)
    for ours, theirs in zip(third.to_numpy_ndarrays(), _flower_oracle(model, updates, m)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    assert [r.stream_release for r in strategy.releases] == [0, 1, 2] and metrics["stream-release"] == 0


def test_clipd_draws_the_nodes_that_train(admin_client):
    """Poisson sampling the server draws (q = 0.5, z = 0): the wrapped FedAvg offers all 20 nodes, only those clipd
    draws for the round's release are sent training, a reply from any other is not sent, and the release is the
    drawn nodes' updates over m."""
    nodes, m = 20, 10
    model, update = _model(), [u * 0.01 for u in _updates(1)[0]]  # (a norm under C: unclipped)
    privacy = _privacy(sampling="poisson", sampling_rate=0.5, drawn_by="server")
    inner = FedAvg(fraction_train=1.0, min_train_nodes=nodes, min_available_nodes=nodes, fraction_evaluate=0.0)
    strategy = ClipdStrategy(inner, admin_client, num_sampled_clients=m, clipping_norm=C, privacy=privacy)
    grid = FixedGrid(nodes)
    messages = list(strategy.configure_train(1, ArrayRecord(model), ConfigRecord(), grid))
    trained = [msg.metadata.dst_node_id for msg in messages]
    drawn = admin_client.draw_clients(strategy.rounds.open_round.aggregation_id, [f"n{n}" for n in grid.nodes])
    assert 0 < len(trained) < nodes and sorted(f"n{n}" for n in trained) == sorted(drawn)
    arrays, _ = strategy.aggregate_train(1, [reply(n, _plus(model, update)) for n in grid.nodes])
    for got, w, u in zip(arrays.to_numpy_ndarrays(), model, update):
        np.testing.assert_allclose(got, w + len(drawn) * u / m, rtol=1e-5, atol=1e-6)
    assert strategy.releases[0].sampling_drawn_by == "server"
