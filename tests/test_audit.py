"""Canary audits of a ledger (docs/privacy.md, "Canary audits"), through a real in-process server and client.

Every expected score and bound is computed here, from what the caller receives (the releases, canaries taken
out) and what the closed audit reveals (its seed): the canaries are derived from the seed as docs/privacy.md
documents it (numpy, written here), their projections read off the releases, their log-likelihood-ratio scores
computed with numpy, and the bound is jax_privacy's ``CanaryScoreAuditor`` on those scores. The server's own
numbers are only compared against them. Broken mechanisms are made by patching the server's noise in this
process (never a switch of the product).
"""

from __future__ import annotations

import math
import subprocess
import sys
import uuid

import grpc
import numpy as np
import pytest
from conftest import ADMIN_TOKEN, TEST_SETTINGS
from jax_privacy.auditing import CanaryScoreAuditor

from clipd.client import Adaptive, Audit, Client, ClipdError, Privacy
from clipd.engine import _privacy as dp
from clipd.engine import _secure_noise as secure
from clipd.engine._correlated import CorrelatedNoise
from clipd.server.app import create_server
from clipd.server.settings import Settings

LAYERS = {"w": (40, 50), "b": (100,)}  # 2,100 parameters
DIMENSION = 2100
CANARIES = 500
CLIP = 1.0
DELTA = 1e-5


@pytest.fixture(scope="module")
def memory_server():
    server, _ = create_server(Settings(**TEST_SETTINGS))
    yield server
    server.stop(grace=1.0)


@pytest.fixture()
def client(memory_server):
    with Client(f"127.0.0.1:{memory_server.port}") as client:
        yield client


def batch(release: int, rows: int = 4) -> dict[str, np.ndarray]:
    """``rows`` examples of norm < 1 whose sum is exact in float32: entries in {-1/64, 0, 1/64}."""
    rng = np.random.default_rng(release)
    return {name: (rng.integers(-1, 2, size=(rows, *shape)) / 64).astype(np.float32) for name, shape in LAYERS.items()}


def flat(arrays: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(arrays[name], np.float64).ravel() for name in LAYERS])


def run_ledger(client, privacy: Privacy, releases: int) -> tuple[list[np.ndarray], list[np.ndarray], list]:
    """``releases`` aggregations on the ledger: what each released (flattened), its raw sum (each example
    clipped to the release's bound), and the releases' fields."""
    released, raw, fields = [], [], []
    for r in range(releases):
        aggregation = client.create_aggregation(LAYERS, l2_norm_clip=CLIP, privacy=privacy)
        data = batch(r)
        client.submit(aggregation, data, client_id=f"site-{r}")
        result = client.finalize(aggregation)
        released.append(flat(result.sums))
        rows = np.concatenate([np.asarray(v, np.float64).reshape(len(v), -1) for v in data.values()], axis=1)
        bound = result.release.bound or CLIP  # each example clipped to the release's bound (optax's global clip)
        scale = np.minimum(1.0, bound / np.linalg.norm(rows, axis=1))
        clipped = {k: (np.asarray(v, np.float64) * scale.reshape(-1, *[1] * (v.ndim - 1))).sum(axis=0)
                   for k, v in data.items()}
        raw.append(flat(clipped))
        fields.append(result.release)
    return released, raw, fields


# The canaries and their scores, as docs/privacy.md documents them, written here -----------------------------
def canaries_of(seed: int, canaries: int, dimension: int):
    rng = np.random.default_rng([seed, 0])
    coordinates = rng.choice(dimension, size=2 * canaries, replace=False)
    signs = rng.integers(0, 2, size=2 * canaries) * 2.0 - 1
    return coordinates, signs


def expected_bound(in_scores, out_scores, confidence=0.95) -> float:
    return float(CanaryScoreAuditor(in_scores, out_scores).epsilon_clopper_pearson(1 - confidence, DELTA))


def independent_scores(seed, released, raw, stddevs, magnitudes, rate=1.0):
    """Each canary's score over independent releases: the sum over every release of the log-likelihood ratio of
    a canary drawn with probability q against an absent one, log(1 - q + q exp((c y - c^2 / 2) / sigma^2)), y its
    projection on the release with the held-in canaries that were drawn put back; c the release's bound
    (``magnitudes``: one per release, or one for all)."""
    coordinates, signs = canaries_of(seed, CANARIES, DIMENSION)
    held_in = np.arange(2 * CANARIES) < CANARIES
    scores = np.zeros(2 * CANARIES)
    if np.ndim(magnitudes) == 0:
        magnitudes = [magnitudes] * len(released)
    for r, (out, total, sigma, magnitude) in enumerate(zip(released, raw, stddevs, magnitudes), start=1):
        drawn = np.ones(2 * CANARIES, bool) if rate >= 1 else np.random.default_rng([seed, r]).random(2 * CANARIES) < rate
        with_canaries = out[coordinates] + np.where(drawn & held_in, signs * magnitude, 0.0)
        y = signs * (with_canaries - total[coordinates])
        share = (magnitude * y - magnitude ** 2 / 2) / sigma ** 2
        scores += share if rate >= 1 else np.log(1 - rate + rate * np.exp(share))
    return scores[:CANARIES], scores[CANARIES:]


def stream_scores(seed, released, raw, sigma, coefs, b, k, magnitude):
    """The same over a correlated stream: projections decorrelated by C, against each canary's participation
    (from release s_i every b releases, k of them) times C."""
    coordinates, signs = canaries_of(seed, CANARIES, DIMENSION)
    starts = np.random.default_rng([seed, 1]).integers(0, b, size=2 * CANARIES)
    t = len(released)
    since = np.arange(t)[None, :] - starts[:, None]
    participation = ((since >= 0) & (since % b == 0) & (since // b < k)).astype(float)
    held_in = (np.arange(2 * CANARIES) < CANARIES)[:, None]
    y = np.stack([signs * (out[coordinates] + participation[:, r] * held_in[:, 0] * signs * magnitude
                           - total[coordinates]) for r, (out, total) in enumerate(zip(released, raw))])
    c = np.array([[coefs[i - j] if 0 <= i - j < len(coefs) else 0.0 for j in range(t)] for i in range(t)])
    signal, observed = (participation * magnitude) @ c.T, y.T @ c.T
    scores = ((signal * observed).sum(1) - (signal ** 2).sum(1) / 2) / sigma ** 2
    return scores[:CANARIES], scores[CANARIES:]


def assert_server_agrees(audit, in_scores, out_scores):
    """The server's scores and bound are the ones computed here."""
    np.testing.assert_allclose(audit.in_scores, in_scores, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(audit.out_scores, out_scores, rtol=1e-4, atol=1e-3)
    assert audit.epsilon_lower == pytest.approx(expected_bound(in_scores, out_scores), rel=1e-6, abs=1e-9)
    assert audit.epsilon_ceiling == pytest.approx(expected_bound(np.ones(CANARIES), np.zeros(CANARIES)), rel=1e-9)
    assert audit.refuted == (audit.epsilon_lower > audit.epsilon_claimed)


def new_ledger() -> str:
    return f"audited-{uuid.uuid4().hex[:10]}"


# Independent noise ---------------------------------------------------------------------------------------
def gaussian(z: float, ledger: str | None = None, **more) -> Privacy:
    """An audited Gaussian policy; with a ``seed`` and a fixed ``ledger`` its run is the same every time (its noise,
    and its canaries, which come from the seed and the ledger id)."""
    return Privacy(ledger or new_ledger(), DELTA, noise_multiplier=z, audit=Audit(canaries=CANARIES), **more)


def audit_independent(client, privacy: Privacy, releases: int, rate: float = 1.0):
    released, raw, fields = run_ledger(client, privacy, releases)
    ledger = client.close_audit(privacy.ledger_id)
    audit = ledger.audit
    assert audit.closed and audit.releases == releases and audit.epsilon_claimed == pytest.approx(ledger.epsilon)
    magnitude = fields[0].bound
    if fields[0].grid_step:
        magnitude = math.floor(magnitude / fields[0].grid_step) * fields[0].grid_step
    in_scores, out_scores = independent_scores(audit.seed, released, raw, [f.noise_stddev for f in fields],
                                               magnitude, rate)
    assert_server_agrees(audit, in_scores, out_scores)
    audit_independent.last = (released, raw)
    return audit


@pytest.mark.parametrize("seed", [11, 12])
@pytest.mark.parametrize("case", ["gaussian", "poisson", "secure"])
def test_a_sound_mechanism_is_not_refuted(client, case, seed):
    if case == "gaussian":
        audit = audit_independent(client, gaussian(4.0, seed=seed), 3)
    elif case == "poisson":
        audit = audit_independent(client, gaussian(1.5, seed=seed, sampling="poisson", sampling_rate=0.3), 4, 0.3)
    else:  # secure noise draws from a CSPRNG only: no seed; the two runs are two draws
        audit = audit_independent(client, gaussian(3.0, noise="secure", accountant="zcdp"), 2)
    assert 0 <= audit.epsilon_lower < audit.epsilon_claimed and not audit.refuted


def test_a_sampled_ledger_is_scored_without_the_secret_of_its_draws(client):
    """Poisson sampling at q = 0.02 over 150 releases (z = 1.5): the claimed epsilon is amplified by the draws'
    being secret. Scores that knew which releases drew each canary would refute this sound ledger; the
    server's, the subsampled Gaussian's likelihood ratio over every release, do not."""
    rate, releases = 0.02, 150
    # A fixed ledger: a seeded policy's canaries come from its seed and ledger id, so this run is the same run
    # every time (its noise, its draws and its canaries).
    privacy = Privacy("sampled-without-its-secret", DELTA, noise_multiplier=1.5, seed=7, sampling="poisson",
                      sampling_rate=rate, audit=Audit(canaries=CANARIES))
    audit = audit_independent(client, privacy, releases, rate)
    assert not audit.refuted and audit.epsilon_lower < audit.epsilon_claimed
    with_the_secret = np.zeros(2 * CANARIES)
    released, raw = audit_independent.last  # (the releases audit_independent scored)
    coordinates, signs = canaries_of(audit.seed, CANARIES, DIMENSION)
    held_in = np.arange(2 * CANARIES) < CANARIES
    for r, (out, total) in enumerate(zip(released, raw), start=1):
        drawn = np.random.default_rng([audit.seed, r]).random(2 * CANARIES) < rate
        y = signs * (out[coordinates] + np.where(drawn & held_in, signs * CLIP, 0.0) - total[coordinates])
        sigma = 1.5 * CLIP
        with_the_secret += np.where(drawn, (CLIP * y - CLIP ** 2 / 2) / sigma ** 2, 0.0)
    assert expected_bound(with_the_secret[:CANARIES], with_the_secret[CANARIES:]) > audit.epsilon_claimed


@pytest.mark.parametrize("break_", ["mean_noise_on_the_sum", "noise_10x_too_small", "secure_noise_10x_too_small"])
def test_broken_noise_is_refuted(client, monkeypatch, break_):
    """Noise calibrated for the mean of m = 4 examples (sigma C / m) added to their sum, noise 10x too small,
    and a discrete Gaussian of a tenth of its scale: each audit's bound passes the claimed epsilon."""
    if break_ == "secure_noise_10x_too_small":
        real_release = secure.release
        monkeypatch.setattr(secure, "release", lambda sums, step, scale, processes=None:
                            real_release(sums, step, scale / 10, processes))
        privacy = gaussian(3.0, noise="secure", accountant="zcdp")
    else:
        shrink = 4 if break_ == "mean_noise_on_the_sum" else 10
        real_noise = dp.add_gaussian_noise
        monkeypatch.setattr(dp, "add_gaussian_noise", lambda sums, stddev, key, dtypes, **more:
                            real_noise(sums, stddev / shrink, key, dtypes, **more))
        privacy = gaussian(10.0, seed=5, ledger=f"broken-{break_}")  # (a fixed run: the audit is random)
    audit = audit_independent(client, privacy, 10 if break_ == "mean_noise_on_the_sum" else 3)
    assert audit.refuted and audit.epsilon_lower > audit.epsilon_claimed


def test_an_audited_release_is_the_unaudited_one(client):
    """Same seed, same data: the release with canaries in and taken out is the release without them, to float
    rounding (the canaries go in before the noise, in float64, and come out of the float32 release)."""
    audited = gaussian(2.0, seed=99)
    plain = Privacy(new_ledger(), DELTA, noise_multiplier=2.0, seed=99)
    with_canaries, _, _ = run_ledger(client, audited, 2)
    without, _, _ = run_ledger(client, plain, 2)
    for a, b in zip(with_canaries, without):
        assert np.max(np.abs(a - b)) / np.max(np.abs(b)) <= 1e-6
        assert np.count_nonzero(a != b) <= 2 * CANARIES  # only the canaries' coordinates may differ (rounding)


def test_an_open_audit_keeps_its_canaries_secret_and_a_closed_one_stays_closed(client):
    privacy = gaussian(4.0, seed=3)
    run_ledger(client, privacy, 1)
    audit = client.ledger(privacy.ledger_id).audit
    assert (audit.canaries, audit.releases, audit.closed) == (CANARIES, 1, False)
    assert (audit.seed, list(audit.in_scores), list(audit.out_scores), audit.epsilon_lower) == (0, [], [], 0.0)
    first = client.close_audit(privacy.ledger_id).audit
    run_ledger(client, privacy, 1)  # released after the close: no canaries, not in the audit
    second = client.close_audit(privacy.ledger_id)
    assert second.audit == first and len(second.entries) == 2 and second.audit.releases == 1


def test_adaptive_clipping_and_noised_statistics_keep_their_accounting(client):
    """The canaries are the server's own: not in the noised count that moves an adaptive bound, nor in the
    released statistics. Same seed, same data: an audited ledger's bounds, statistics and epsilon are an
    unaudited one's, and its canaries follow each release's bound."""
    settings = dict(noise_multiplier=2.0, seed=31, public_denominator=4.0, metrics_noise_multiplier=10.0,
                    adaptive=Adaptive(count_stddev=10.0, initial_bound=0.5))
    audited = Privacy(new_ledger(), DELTA, audit=Audit(canaries=CANARIES), **settings)
    released, raw, fields = run_ledger(client, audited, 3)
    _, _, plain = run_ledger(client, Privacy(new_ledger(), DELTA, **settings), 3)
    for a, b in zip(fields, plain):
        for name in ("bound", "next_bound", "unclipped_fraction", "examples", "ledger_epsilon", "noise_stddev"):
            assert getattr(a, name) == getattr(b, name), name
        assert list(a.example_norm_histogram) == list(b.example_norm_histogram)
        assert list(a.layer_clipped) == list(b.layer_clipped)
    assert len({f.bound for f in fields}) == 3  # the bound moved with each release
    audit = client.close_audit(audited.ledger_id).audit
    in_scores, out_scores = independent_scores(audit.seed, released, raw, [f.noise_stddev for f in fields],
                                               [f.bound for f in fields])
    assert_server_agrees(audit, in_scores, out_scores)
    assert not audit.refuted


# Correlated streams and DP-SGD ------------------------------------------------------------------------------
STREAM = dict(mechanism="banded", releases=6, min_separation=2, max_participations=3, declared_participation=True)


@pytest.mark.parametrize("break_", [None, "noise_10x_too_small", "identity_stream"])
def test_a_banded_stream_is_audited_on_its_decorrelated_releases(client, monkeypatch, break_):
    """A banded stream's audit closes by itself with its last release. Sound: not refuted. Its noise a tenth:
    refuted. C^-1 replaced by the identity (independent noise of the stream's sigma per release): not seen,
    and rightly: for a participant in k releases b apart that is a Gaussian mechanism of sqrt(k) c / sigma,
    no more than sens(C) c / sigma, the claim."""
    real_step = CorrelatedNoise.step
    if break_ == "noise_10x_too_small":
        monkeypatch.setattr(CorrelatedNoise, "step", lambda self, z, state: real_step(self, z, state) / 10)
    elif break_ == "identity_stream":
        monkeypatch.setattr(CorrelatedNoise, "step", lambda self, z, state: np.asarray(z, np.float64))
    privacy = Privacy(new_ledger(), DELTA, noise_multiplier=3.0, seed=21, audit=Audit(canaries=CANARIES), **STREAM)
    released, raw, fields = run_ledger(client, privacy, STREAM["releases"])
    ledger = client.ledger(privacy.ledger_id)
    audit = ledger.audit
    assert audit.closed and audit.releases == 6 and audit.epsilon_claimed == pytest.approx(ledger.epsilon)
    in_scores, out_scores = stream_scores(audit.seed, released, raw, fields[0].stream_noise_stddev,
                                          list(ledger.stream.strategy), 2, 3, fields[0].bound)
    assert_server_agrees(audit, in_scores, out_scores)
    assert audit.refuted == (break_ == "noise_10x_too_small")
    if break_ == "identity_stream":
        assert math.sqrt(3) <= fields[0].sensitivity / fields[0].bound * (1 + 1e-9)  # sens(C) >= sqrt(k)


def test_dp_sgd_steps_carry_canary_examples(client):
    """DpSgd's Poisson steps (a mean of the noised sum): canaries drawn as examples are, taken out before the
    mean; the audit of a sound trainer is not refuted."""
    from clipd.client.dpsgd import DpSgd

    rng = np.random.default_rng(0)
    with DpSgd(client, {"w": (DIMENSION,)}, l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=0.5,
               dataset_size=16, delta=DELTA, seed=4, audit=Audit(canaries=CANARIES)) as trainer:
        for _ in range(4):
            trainer.step({"w": rng.normal(size=(8, DIMENSION)).astype(np.float32) * 0.01})
    audit = client.close_audit(trainer.ledger_id).audit
    assert audit.releases == 4 and 0 <= audit.epsilon_lower < audit.epsilon_claimed


# Refusals ---------------------------------------------------------------------------------------------------
def test_refusals_are_clear_and_lose_nothing(client):
    too_many = Privacy(new_ledger(), DELTA, noise_multiplier=2.0, audit=Audit(canaries=DIMENSION // 2 + 1))
    with pytest.raises(ClipdError, match="needs 2102 coordinates") as e:
        client.create_aggregation(LAYERS, l2_norm_clip=CLIP, privacy=too_many)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    for bad, words in ((dict(debug_raw_statistics=True), "debug_raw_statistics"),
                       (dict(noise_multiplier=0.0), "noise_multiplier 0")):
        privacy = Privacy(new_ledger(), DELTA, **{"noise_multiplier": 2.0, **bad}, audit=Audit(canaries=10))
        with pytest.raises(ClipdError, match=words) as e:
            client.create_aggregation(LAYERS, l2_norm_clip=CLIP, privacy=privacy)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ClipdError, match="confidence") as e:
        client.create_aggregation(LAYERS, l2_norm_clip=CLIP, privacy=Privacy(
            new_ledger(), DELTA, noise_multiplier=2.0, audit=Audit(canaries=10, confidence=1.5)))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT

    plain = Privacy(new_ledger(), DELTA, noise_multiplier=2.0, seed=1)
    released, _, _ = run_ledger(client, plain, 1)
    before = client.ledger(plain.ledger_id)
    late = Privacy(plain.ledger_id, DELTA, noise_multiplier=2.0, seed=1, audit=Audit(canaries=10))
    with pytest.raises(ClipdError, match="an audit is the ledger's from its first aggregation") as e:
        client.create_aggregation(LAYERS, l2_norm_clip=CLIP, privacy=late)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(ClipdError, match="has no audit") as e:
        client.close_audit(plain.ledger_id)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(ClipdError) as e:
        client.close_audit("no-such-ledger")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    after = client.ledger(plain.ledger_id)
    assert after == before and not after.HasField("audit")  # nothing of the ledger moved
    again, _, _ = run_ledger(client, plain, 1)  # and it goes on as before
    assert len(client.ledger(plain.ledger_id).entries) == 2


# Durability, roles and where it shows ------------------------------------------------------------------------
def test_an_audit_survives_a_restart(tmp_path):
    settings = Settings(**{**TEST_SETTINGS, "data_dir": str(tmp_path / "data")})
    privacy = gaussian(4.0, seed=8)
    server, _ = create_server(settings)
    try:
        with Client(f"127.0.0.1:{server.port}") as c:
            first = run_ledger(c, privacy, 2)
    finally:
        server.stop(grace=1.0)
    server, _ = create_server(settings)
    try:
        with Client(f"127.0.0.1:{server.port}") as c:
            assert c.ledger(privacy.ledger_id).audit.releases == 2
            second = run_ledger(c, privacy, 1)
            audit = c.close_audit(privacy.ledger_id).audit
    finally:
        server.stop(grace=1.0)
    released, raw, fields = (a + b for a, b in zip(first, second))
    in_scores, out_scores = independent_scores(audit.seed, released, raw, [f.noise_stddev for f in fields], CLIP)
    assert audit.releases == 3
    assert_server_agrees(audit, in_scores, out_scores)


def test_the_cli_admin_api_metrics_and_status_show_it(auth_server, monkeypatch):
    import httpx

    target = f"127.0.0.1:{auth_server.port}"
    privacy = gaussian(10.0, seed=2)
    with Client(target, token=ADMIN_TOKEN) as admin:
        run_ledger(admin, privacy, 1)
        submitter = admin.get_aggregation(admin.create_aggregation(LAYERS, l2_norm_clip=CLIP)).submit_token
        with Client(target, token=submitter) as c, pytest.raises(ClipdError) as e:
            c.close_audit(privacy.ledger_id)  # a submit token may not close an audit
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    base = f"http://127.0.0.1:{auth_server.admin.port}"
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    shown = httpx.get(f"{base}/api/v1/ledgers/{privacy.ledger_id}", headers=headers).json()["audit"]
    assert shown["closed"] is False and shown["canaries"] == CANARIES and "in_scores" not in shown

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "clipd", "audit", privacy.ledger_id, "--target", target, *args],
                              capture_output=True, text=True, timeout=120)

    refused = cli()  # no token: the admin's is needed
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    done = cli("--token", ADMIN_TOKEN)
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    shown = httpx.get(f"{base}/api/v1/ledgers/{privacy.ledger_id}", headers=headers).json()["audit"]
    assert last == (f"audit: ledger={privacy.ledger_id} canaries={CANARIES} epsilon_lower={shown['epsilon_lower']:.6g}"
                    f" epsilon_claimed={shown['epsilon_claimed']:.6g} confidence=0.95")
    assert shown["closed"] and len(shown["in_scores"]) == CANARIES and shown["epsilon_lower"] < shown["epsilon_claimed"]
    metrics = httpx.get(f"{base}/metrics", headers=headers).text
    for line in (f'clipd_ledger_audit_refuted{{ledger="{privacy.ledger_id}"}} 0.0',
                 f'clipd_ledger_audit_epsilon{{bound="lower",ledger="{privacy.ledger_id}"}}'):
        assert line in metrics
    status = subprocess.run([sys.executable, "-m", "clipd", "status", "--admin", base, "--token", ADMIN_TOKEN],
                            capture_output=True, text=True, timeout=120)
    row = next(line for line in status.stdout.splitlines() if line.startswith(privacy.ledger_id))
    assert row.rstrip().endswith(f">= {shown['epsilon_lower']:.6g} (claimed {shown['epsilon_claimed']:.6g}) at 95%")


def test_the_cli_exits_3_when_an_audit_refutes_its_ledger(memory_server, monkeypatch):
    real_noise = dp.add_gaussian_noise
    monkeypatch.setattr(dp, "add_gaussian_noise", lambda sums, stddev, key, dtypes, **more:
                        real_noise(sums, stddev / 10, key, dtypes, **more))
    privacy = gaussian(10.0, seed=6)
    with Client(f"127.0.0.1:{memory_server.port}") as c:
        run_ledger(c, privacy, 2)
    done = subprocess.run([sys.executable, "-m", "clipd", "audit", privacy.ledger_id,
                           "--target", f"127.0.0.1:{memory_server.port}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and "REFUTED" in done.stdout


def test_an_audit_travels_in_an_nvflare_jobs_configuration():
    """NVFlare rebuilds the aggregator from builtins in the job's configuration: the audit comes back an Audit."""
    import json

    from clipd.client.nvflare import _privacy, privacy_config

    privacy = Privacy("flare", DELTA, noise_multiplier=1.0, audit=Audit(canaries=7, confidence=0.9))
    config = json.loads(json.dumps(privacy_config(privacy)))
    assert config["audit"] == {"canaries": 7, "confidence": 0.9} and _privacy(config) == privacy
