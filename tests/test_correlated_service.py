"""Correlated noise through the real server: the noise stream of a ledger's releases against jax_privacy's
streaming C^-1 on the same draws, its epsilon against dp_accounting, a restart that continues the stream,
participation enforced per client, and every refusal with its numbers.

The oracle builds the expected releases itself: jax_privacy 2.0's BLT optimizer for (n, b, k), its streaming
inverse of C on the unit draws the server's seeded key gives (jax.random, float32 normals), its
min-separation sensitivity, and dp_accounting's PLD accountant on one Gaussian event.
"""

from __future__ import annotations

import uuid

import dp_accounting
import jax
import numpy as np
import pytest
from jax_privacy.matrix_factorization import buffered_toeplitz, toeplitz

from clipd.client import Client, FailedPreconditionError, InvalidArgumentError, Privacy
from clipd.server.app import create_server
from clipd.server.settings import Settings
from clipd.v1 import clipd_pb2 as pb

N, B, K, BUFFERS, Z, SEED = 6, 2, 3, 2, 1.0, 1234
LAYERS = {"w": (4,), "b": (3,)}  # 7 parameters
PARAMETERS = 7


def _settings(**overrides) -> Settings:
    from conftest import TEST_SETTINGS

    return Settings(**{**TEST_SETTINGS, **overrides})


@pytest.fixture(scope="module")
def oracle():
    """jax_privacy's BLT for (N, B, K) with BUFFERS buffers: its C^-1 rows on the server's seeded draws, and
    its sensitivity."""
    with jax.enable_x64():
        blt = buffered_toeplitz.optimize(n=N, min_sep=B, max_participations=K, min_buffers=BUFFERS,
                                         max_buffers=BUFFERS)
        coefs = blt.toeplitz_coefs(N)
        sens = float(np.sqrt(toeplitz.minsep_sensitivity_squared(coefs, min_sep=B, max_participations=K)))
        prefix = [float(np.sqrt(toeplitz.minsep_sensitivity_squared(coefs[:t], min_sep=B, max_participations=K)))
                  for t in range(1, N + 1)]
        draws = np.stack([np.asarray(jax.random.normal(jax.random.fold_in(jax.random.key(SEED), t + 1),
                                                       (PARAMETERS,), dtype=np.float32), np.float64)
                          for t in range(N)])
        stream = blt.inverse_as_streaming_matrix()
        rows = np.asarray(stream @ jax.numpy.asarray(draws))
        # Release t's noise stddev per coordinate: sigma times the norm of row t of C^-1 (C from its coefficients).
        inverse_rows = np.linalg.norm(np.linalg.inv(np.asarray(toeplitz.materialize_lower_triangular(coefs))), axis=1)
    return {"sens": sens, "prefix": prefix, "rows": rows, "coefs": np.asarray(coefs), "inverse_rows": inverse_rows}


def _privacy(ledger: str, **overrides) -> Privacy:
    fields = dict(ledger_id=ledger, delta=1e-5, noise_multiplier=Z, accountant="pld", seed=SEED, mechanism="blt",
                  releases=N, min_separation=B, max_participations=K, buffers=BUFFERS)
    return Privacy(**{**fields, **overrides})


def _pld_epsilon(multiplier: float) -> float:
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.GaussianDpEvent(multiplier), 1)
    return accountant.get_epsilon(1e-5)


def _round(client: Client, privacy: Privacy, clients: list[str], rng) -> tuple:
    """One aggregation of ``privacy``'s ledger: one small example (norm < 1, never clipped) per client; the
    exact sum and the release."""
    aggregation = client.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=privacy)
    exact = np.zeros(PARAMETERS)
    for name in clients:
        example = {"w": rng.uniform(-0.2, 0.2, 4).astype(np.float32), "b": rng.uniform(-0.2, 0.2, 3).astype(np.float32)}
        exact += np.concatenate([example["w"], example["b"]]).astype(np.float64)
        client.submit(aggregation, example, client_id=name)
    result = client.finalize(aggregation)
    released = np.concatenate([result.sums["w"], result.sums["b"]]).astype(np.float64)
    return exact, released, result.release


def test_a_stream_is_jax_privacys_noise_and_a_restart_carries_it_on(tmp_path, oracle):
    """Releases 0-2 on one server, 3-5 on a second one on the same store: each release's noise is row t of
    sigma C^-1 Z (sigma = z clip sens), its epsilon dp_accounting's for the first t+1 releases as one Gaussian
    event; then the stream is spent."""
    ledger, rng = f"blt-{uuid.uuid4().hex[:8]}", np.random.default_rng(5)
    sigma = Z * 1.0 * oracle["sens"]
    groups = [["a0", "b0"], ["a1"], ["c2", "d2"], ["a3"], ["e4"], ["b5"]]  # b=2, k=3 kept
    for first, last in ((0, 3), (3, N)):
        server, port = create_server(_settings(data_dir=str(tmp_path)))
        try:
            with Client(f"127.0.0.1:{port}") as client:
                for t in range(first, last):
                    exact, released, release = _round(client, _privacy(ledger), groups[t], rng)
                    np.testing.assert_allclose(released - exact, sigma * oracle["rows"][t], rtol=1e-5, atol=2e-6)
                    assert (release.mechanism, release.stream_release, release.stream_releases) == ("blt", t, N)
                    # What the release says of its noise: the stream's sigma, this release's own stddev, the
                    # stream's sensitivity, its epsilon alone (a Gaussian of that stddev over the clip bound).
                    assert release.stream_noise_stddev == pytest.approx(sigma, rel=1e-9)
                    assert release.noise_stddev == pytest.approx(sigma * oracle["inverse_rows"][t], rel=1e-9)
                    assert release.sensitivity == pytest.approx(1.0 * oracle["sens"], rel=1e-9)
                    assert release.epsilon == pytest.approx(_pld_epsilon(sigma * oracle["inverse_rows"][t] / 1.0),
                                                            rel=1e-6)
                    assert release.unit == pb.EXAMPLE and release.client_ids == "self_asserted"  # (no auth)
                    # The strategy, rebuilt as jax_privacy's BLT: the same C.
                    theta, omega = np.split(np.asarray(release.stream.strategy), 2)
                    with jax.enable_x64():
                        rebuilt = buffered_toeplitz.BufferedToeplitz.build(buf_decay=theta, output_scale=omega)
                        np.testing.assert_allclose(np.asarray(rebuilt.toeplitz_coefs(N)), oracle["coefs"], rtol=1e-12)
                    assert release.ledger_epsilon == pytest.approx(
                        _pld_epsilon(Z * oracle["sens"] / oracle["prefix"][t]), rel=1e-6)
                ledger_view = client.ledger(ledger)
                assert (ledger_view.mechanism, ledger_view.stream_made, ledger_view.stream.releases) == ("blt", last, N)
                assert (ledger_view.stream_state_rows, ledger_view.stream_state_bytes) == (BUFFERS, BUFFERS * 7 * 8)
                if last == N:
                    assert release.ledger_epsilon == pytest.approx(_pld_epsilon(Z), rel=1e-6)  # one event of z
                    with pytest.raises(FailedPreconditionError, match=(
                            rf"the noise stream of ledger '{ledger}' is spent: 6 of its 6 planned releases are made")):
                        client.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=_privacy(ledger))
        finally:
            server.stop(grace=0.5)


def test_participation_is_enforced_per_client_before_its_bytes_are_summed(client):
    """b=2, k=3: alice in release 0 is refused in release 1 (with when she may come back), taken in release
    2; after three releases she is refused for good. A refused stream leaves the sum untouched."""
    ledger, rng = f"blt-{uuid.uuid4().hex[:8]}", np.random.default_rng(1)
    privacy = _privacy(ledger)
    _round(client, privacy, ["alice", "bob"], rng)
    aggregation = client.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=privacy)
    example = {"w": np.full(4, 0.1, np.float32), "b": np.zeros(3, np.float32)}
    with pytest.raises(FailedPreconditionError, match=(
            rf"client 'alice' took part in release 0 of ledger '{ledger}'; this is release 1 and its stream needs"
            r" 2 between two \(min_separation\): it may take part again from release 2")):
        client.submit(aggregation, example, client_id="alice")
    with pytest.raises(FailedPreconditionError, match="took part in release 0"):
        client.submit(aggregation, example, client_id="alice~1")  # a spread stream of alice is alice
    client.submit(aggregation, example, client_id="carol")
    assert client.finalize(aggregation).release.stream_release == 1
    _round(client, privacy, ["alice"], rng)  # release 2
    _round(client, privacy, ["dave"], rng)  # release 3
    _round(client, privacy, ["alice"], rng)  # release 4: her third
    aggregation = client.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=privacy)
    with pytest.raises(FailedPreconditionError, match=(
            r"client 'alice' took part in 3 releases of ledger .* \(releases \[0, 2, 4\]\); its stream allows at"
            r" most 3 \(max_participations\)")):
        client.submit(aggregation, example, client_id="alice")
    client.cancel(aggregation)


def test_declared_participation_is_not_enforced(client):
    privacy = _privacy(f"blt-{uuid.uuid4().hex[:8]}", declared_participation=True)
    rng = np.random.default_rng(2)
    _round(client, privacy, ["trainer"], rng)
    _, _, release = _round(client, privacy, ["trainer"], rng)
    assert release.stream_release == 1


def test_one_aggregation_of_a_correlated_ledger_is_open_at_a_time_and_the_ledger_keeps_its_stream(client):
    ledger = f"blt-{uuid.uuid4().hex[:8]}"
    first = client.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=_privacy(ledger))
    with pytest.raises(FailedPreconditionError, match=(
            rf"ledger '{ledger}' releases one correlated noise stream in order: one aggregation at a time;"
            rf" finalize or cancel {first} first")):
        client.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=_privacy(ledger))
    client.cancel(first)
    for layers, other in ((LAYERS, _privacy(ledger, mechanism="independent", max_participations=0)),
                          (LAYERS, _privacy(ledger, releases=N + 1)),
                          ({"w": (5,), "b": (3,)}, _privacy(ledger))):  # another model: another state size
        with pytest.raises(FailedPreconditionError, match=f"ledger '{ledger}' exists with"):
            client.create_aggregation(layers, l2_norm_clip=1.0, privacy=other)
    client.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=_privacy(ledger))  # free again


def test_a_stream_past_the_budget_is_refused_at_creation(client):
    with pytest.raises(FailedPreconditionError, match=(
            r"its stream of 6 releases \(noise multiplier 1\) spends epsilon 4\.37\d+, past max_epsilon 2")):
        client.create_aggregation(LAYERS, l2_norm_clip=1.0,
                                  privacy=_privacy(f"blt-{uuid.uuid4().hex[:8]}", max_epsilon=2.0))


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(min_separation=7), r"min_separation must be in \[1, releases=6\], got 7"),
    (dict(min_separation=0), r"min_separation must be in \[1, releases=6\], got 0"),
    (dict(buffers=7), r"buffers must be in \[1, min\(releases=6, 10\)\], got 7"),
    (dict(releases=0), "releases must be >= 1, got 0"),
    (dict(mechanism="banded", buffers=3), "a banded strategy has at most min_separation=2 bands"),
    (dict(noise="secure", accountant="zcdp", seed=None), "correlated noise \\(blt\\) does not take secure noise"),
    (dict(sampling="poisson", sampling_rate=0.1), "does not take sampling amplification"),
])
def test_streams_no_strategy_serves_are_invalid_arguments(client, overrides, message):
    with pytest.raises(InvalidArgumentError, match=message):
        client.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=_privacy(f"x-{uuid.uuid4().hex[:8]}", **overrides))


def test_dpsgd_with_a_blt_stream_declares_its_epochs(client):
    """DpSgd(mechanism="blt"): 6 steps in 3 epochs (b = 2, k = 3, declared: the module's stream, whose strategy
    this process has made), the same trainer every step; its epsilon after the last step is one Gaussian event
    of z (dp_accounting); a seventh step is refused."""
    from clipd.client.dpsgd import DpSgd

    rng = np.random.default_rng(4)
    with DpSgd(client, {"w": (3,)}, l2_norm_clip=1.0, noise_multiplier=2.0, sampling_rate=0.5, dataset_size=8,
               delta=1e-5, accountant="pld", mechanism="blt", steps=N, epochs=K, buffers=BUFFERS, seed=7) as trainer:
        releases = [trainer.step({"w": rng.normal(size=(4, 3)).astype(np.float32)}).release for _ in range(N)]
        assert [(r.mechanism, r.stream_release) for r in releases] == [("blt", t) for t in range(N)]
        assert trainer.epsilon == pytest.approx(_pld_epsilon(2.0), rel=1e-6)
        assert releases[0].ledger_epsilon < releases[-1].ledger_epsilon
        with pytest.raises(FailedPreconditionError, match="is spent: 6 of its 6 planned releases are made"):
            trainer.step({"w": rng.normal(size=(4, 3)).astype(np.float32)})
    with pytest.raises(ValueError, match=r"steps \(5\) a multiple of epochs \(2\)"):
        DpSgd(client, {"w": (3,)}, l2_norm_clip=1.0, noise_multiplier=2.0, sampling_rate=0.5, dataset_size=8,
              delta=1e-5, mechanism="blt", steps=5, epochs=2)


def test_the_admin_api_and_metrics_show_the_stream_and_its_refusals(tmp_path):
    """GET /api/v1/ledgers/{id}: the mechanism, the stream (made, left, state rows and bytes) and the
    participation refusals; /metrics: the same as clipd_ledger_stream_* series."""
    import json
    import urllib.request

    server, port = create_server(_settings(data_dir=str(tmp_path), admin_port=0))
    try:
        ledger, rng = f"blt-{uuid.uuid4().hex[:8]}", np.random.default_rng(3)
        with Client(f"127.0.0.1:{port}") as client:
            _round(client, _privacy(ledger), ["alice"], rng)
            aggregation = client.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=_privacy(ledger))
            with pytest.raises(FailedPreconditionError):
                client.submit(aggregation, {"w": np.zeros(4, np.float32), "b": np.zeros(3, np.float32)},
                              client_id="alice")
            view = client.get_aggregation(aggregation)
            assert view.privacy.correlated.mechanism == view.privacy.correlated.BLT

        def get(path):
            with urllib.request.urlopen(f"http://127.0.0.1:{server.admin.port}{path}", timeout=30) as response:
                return response.read().decode()

        described = json.loads(get(f"/api/v1/ledgers/{ledger}"))
        assert described["mechanism"] == "blt" and described["participation_refusals"] == 1
        stream = described["stream"]
        assert (stream["made"], stream["left"], stream["state_rows"], stream["state_bytes"]) == (1, N - 1, BUFFERS,
                                                                                                 BUFFERS * 7 * 8)
        assert (stream["releases"], stream["min_separation"], stream["max_participations"]) == (N, B, K)
        assert json.loads(get(f"/api/v1/aggregations/{aggregation}"))["privacy"]["mechanism"] == "blt"
        metrics = get("/metrics")
        assert f'clipd_ledger_stream_releases_left{{ledger="{ledger}",mechanism="blt"}} 5.0' in metrics
        assert f'clipd_ledger_stream_state_bytes{{ledger="{ledger}",mechanism="blt"}} {BUFFERS * 56}.0' in metrics
        assert f'clipd_ledger_participation_refusals_total{{ledger="{ledger}"}} 1.0' in metrics
    finally:
        server.stop(grace=0.5)


def test_target_epsilon_calibrates_z_for_the_whole_stream_as_one_event(client):
    """target_epsilon with a stream: z is dp_accounting's calibration of one Gaussian event (PLD), whatever n."""
    privacy = _privacy(f"blt-{uuid.uuid4().hex[:8]}", noise_multiplier=None, target_epsilon=2.0)
    _, _, release = _round(client, privacy, ["alice"], np.random.default_rng(8))
    expected = dp_accounting.calibrate_dp_mechanism(
        lambda: dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4), dp_accounting.GaussianDpEvent,
        2.0, 1e-5)
    assert release.noise_multiplier == pytest.approx(expected, rel=1e-6)
    assert _pld_epsilon(release.noise_multiplier) == pytest.approx(2.0, abs=1e-3)


def test_a_buffered_stream_releases_the_noise_stream_in_version_order_and_ends_with_it(client, oracle):
    """A buffered stream of K=2 on the BLT ledger (b=2, k=3, N=6): version V is the ledger's release V-1, its
    noise row t=V-1 of sigma C^-1 Z; a client back too soon goes into the buffer its b allows (not refused);
    once version 6 is out the stream has stopped (its noise stream's planned releases) and refuses more, and
    the ledger's epsilon is dp_accounting's for one Gaussian of z. Correlated noise with declared
    participation is refused (a stream enforces it)."""
    from clipd.client import Buffer

    ledger, rng = f"blt-{uuid.uuid4().hex[:8]}", np.random.default_rng(7)
    sigma = Z * 1.0 * oracle["sens"]
    sid = client.create_stream(LAYERS, l2_norm_clip=1.0, privacy=_privacy(ledger),
                               buffer=Buffer(size=2, staleness_exponent=0.0, max_staleness=N))
    # a back while version 2 fills goes into version 3 (b=2); a fourth of a's is refused (k=3).
    schedule = [("a", 1), ("b", 1), ("a", 3), ("c", 2), ("d", 2), ("b", 3), ("c", 4), ("d", 4), ("a", 5),
                ("a", None), ("b", 5), ("c", 6), ("d", 6)]
    exact = np.zeros((N + 1, PARAMETERS))
    sequence = dict.fromkeys("abcd", 0)
    for name, version in schedule:
        example = {"w": rng.uniform(-0.2, 0.2, 4).astype(np.float32), "b": rng.uniform(-0.2, 0.2, 3).astype(np.float32)}
        sequence[name] += 1
        if version is None:
            with pytest.raises(FailedPreconditionError, match="took part in 3 releases .* its stream allows at most 3"):
                client.submit_to_stream(sid, example, trained_from=0, client_id=name, sequence=sequence[name])
            continue
        ack = client.submit_to_stream(sid, example, trained_from=0, client_id=name, sequence=sequence[name])
        assert (ack.version, ack.weight) == (version, 1.0)
        exact[version] += np.concatenate([example["w"], example["b"]]).astype(np.float64)
    for update in client.watch_releases(sid, after=0, timeout=60):
        t = update.version - 1
        released = np.concatenate([update.sums["w"], update.sums["b"]]).astype(np.float64)
        np.testing.assert_allclose(released - exact[update.version], sigma * oracle["rows"][t], rtol=1e-5, atol=2e-6)
        assert (update.release.mechanism, update.release.stream_release) == ("blt", t)
        assert update.release.ledger_epsilon == pytest.approx(_pld_epsilon(Z * oracle["sens"] / oracle["prefix"][t]),
                                                              rel=1e-6)
        if update.version == N:
            break
    view = client.stream(sid)
    assert view.version == N and view.state == "stopped" and "planned releases" in view.reason
    with pytest.raises(FailedPreconditionError, match="stopped"):
        client.submit_to_stream(sid, {"w": np.zeros(4, np.float32), "b": np.zeros(3, np.float32)}, trained_from=N,
                                client_id="c", sequence=4)
    assert client.ledger(ledger).stream_made == N
    with pytest.raises(InvalidArgumentError, match="declared participation"):
        client.create_stream(LAYERS, privacy=_privacy(f"blt-{uuid.uuid4().hex[:8]}", declared_participation=True),
                             buffer=Buffer(size=2))
