"""Canary audits of a ledger (docs/privacy.md, "Canary audits"), through a real in-process server and client.

Every expected score and bound is computed here, from what the caller receives (the releases, canaries taken
out) and what the closed audit reveals (its seed): the canaries are derived from the seed as docs/privacy.md
documents it (numpy, written here), their correct clips computed here from the policy's bounds, their
projections read off the releases, their log-likelihood-ratio scores computed with numpy, and the bound is
jax_privacy's ``CanaryScoreAuditor`` on those scores. The server's own numbers are only compared against them.
Broken mechanisms (noise, the clip, the unit) are made by patching the server's functions in this process
(never a switch of the product).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import subprocess
import sys
import uuid

import grpc
import jax
import numpy as np
import pytest
from conftest import ADMIN_TOKEN, TEST_SETTINGS
from jax_privacy.auditing import CanaryScoreAuditor

from clipd import cli
from clipd.client import Adaptive, Audit, Client, ClipdError, Privacy
from clipd.engine import _accumulator, _unit
from clipd.engine import _privacy as dp
from clipd.engine import _secure_noise as secure
from clipd.engine._correlated import CorrelatedNoise
from clipd.server.app import create_server
from clipd.server.settings import Settings

LAYERS = {"w": (40, 50), "b": (100,)}  # 2,100 parameters: "b" is too small to give each canary a coordinate
SIZES = [2000, 100]
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


def bounds_of(policy: str, bound: float) -> list[float]:
    """The bound of each clip group: one (global), or each layer's (per_layer_uniform: C / sqrt(K))."""
    return [bound] if policy == "global" else [bound / math.sqrt(len(LAYERS))] * len(LAYERS)


def clipped_sum(data: dict[str, np.ndarray], bounds: list[float], unit: str) -> np.ndarray:
    """The flattened sum of the batch's contributions clipped to ``bounds`` (one: over the whole contribution;
    else per layer): each row (example unit), or the rows' sum in float32 (client unit)."""
    rows = [np.asarray(v, np.float64).reshape(len(v), -1) for v in data.values()]
    if unit == "client":
        rows = [np.sum(r, axis=0, keepdims=True).astype(np.float32).astype(np.float64) for r in rows]
    if len(bounds) == 1:
        scale = np.minimum(1.0, bounds[0] / np.linalg.norm(np.concatenate(rows, axis=1), axis=1))
        rows = [r * scale[:, None] for r in rows]
    else:
        rows = [r * np.minimum(1.0, c / np.linalg.norm(r, axis=1))[:, None] for r, c in zip(rows, bounds)]
    return np.concatenate([r.sum(axis=0) for r in rows])


def run_ledger(client, privacy: Privacy, releases: int, policy: str = "global", unit: str = "example",
               rows: int = 4) -> tuple[list[np.ndarray], list[np.ndarray], list]:
    """``releases`` aggregations on the ledger: what each released (flattened), its raw sum (clipped as the
    policy and unit say, at the release's bound), and the releases' fields."""
    released, raw, fields = [], [], []
    for r in range(releases):
        aggregation = client.create_aggregation(LAYERS, l2_norm_clip=CLIP, privacy=privacy, policy=policy, unit=unit)
        data = batch(r, rows)
        site = f"site-{r}"
        if privacy.drawn_by == "server":  # a client the server drew for this release
            site = client.draw_clients(aggregation, [f"site-{r}-{i}" for i in range(100)])[0]
        client.submit(aggregation, data, client_id=site)
        result = client.finalize(aggregation)
        released.append(flat(result.sums))
        raw.append(clipped_sum(data, bounds_of(policy, result.release.bound or CLIP), unit))
        fields.append(result.release)
    return released, raw, fields


# The canaries and their scores, as docs/privacy.md documents them, written here -----------------------------
def canaries_of(seed: int, canaries: int = CANARIES, sizes=SIZES) -> dict:
    """The layout: per layer the canaries with a coordinate there, that coordinate and its sign; each canary's
    factor (norm / bound), and a client-unit canary's rows and their shares."""
    rng = np.random.default_rng([seed, 0])
    count = 2 * canaries
    order = rng.permutation(count)
    members, positions, signs, offset = [], [], [], 0
    for size in sizes:
        m = min(count, size)
        members.append(order[(offset + np.arange(m)) % count])
        positions.append(rng.choice(size, size=m, replace=False))
        signs.append(rng.integers(0, 2, size=m) * 2.0 - 1)
        offset = (offset + m) % count
    factors = 10.0 ** rng.uniform(3, 4, size=count)
    rows = rng.integers(2, 9, size=count)
    weights = rng.uniform(0.5, 1.5, size=rows.sum())
    shares = np.split(weights, np.cumsum(rows)[:-1])
    return dict(members=members, positions=positions, signs=signs, factors=factors,
                shares=[w / w.sum() for w in shares], count=count)


def correct_clips(layout: dict, bounds: list[float], unit: str = "example", grid_step: float = 0.0) -> np.ndarray:
    """(2N, D): each canary's vector clipped as the policy says, on its coordinates (flattened model); on a
    secure grid, rounded to it."""
    if grid_step:
        return np.rint(correct_clips(layout, bounds, unit) / grid_step) * grid_step
    count = layout["count"]
    vectors = np.zeros((count, DIMENSION))
    spread = np.sqrt(sum(np.bincount(m, minlength=count) for m in layout["members"]))
    offsets = np.concatenate([[0], np.cumsum(SIZES)[:-1]])
    for k, (members, positions, signs) in enumerate(zip(layout["members"], layout["positions"], layout["signs"])):
        scale = bounds[k] if len(bounds) > 1 else bounds[0] / spread[members]
        base = signs * layout["factors"][members] * scale
        if unit == "client":  # its rows, each in float32, summed in float64, held in float32
            value = np.array([np.sum(np.float32(b * layout["shares"][i]), dtype=np.float64)
                              for b, i in zip(base, members)], np.float32)
        else:
            value = base.astype(np.float32)
        vectors[members, offsets[k] + positions] = value
    if len(bounds) == 1:
        return vectors * np.minimum(1.0, bounds[0] / np.linalg.norm(vectors, axis=1))[:, None]
    out = vectors.copy()
    for k, c in enumerate(bounds):
        part = slice(offsets[k], offsets[k] + SIZES[k])
        out[:, part] = np.sign(vectors[:, part]) * np.minimum(np.abs(vectors[:, part]), c)
    return out


def expected_bound(in_scores, out_scores, confidence=0.95) -> float:
    return float(CanaryScoreAuditor(in_scores, out_scores).epsilon_clopper_pearson(1 - confidence, DELTA))


def projections_of(clips: np.ndarray, out: np.ndarray, total: np.ndarray, added: np.ndarray) -> np.ndarray:
    """Each canary's projection on the direction of its correct clip: the release with the added canaries' clips
    put back, beyond the raw sum (their supports are disjoint: canary i's own clip is what is put back there)."""
    norms = np.linalg.norm(clips, axis=1)
    return (clips @ (out - total) + np.where(added, norms ** 2, 0.0)) / norms


def server_draws(seed: int, ledger: str, release: int, rate: float) -> np.ndarray:
    """A server-drawn ledger's canaries: HMAC-SHA256 under sha256("clipd-audit-draws/<seed>") of
    "clipd-draw/1" 0 ledger 0 release 0 "canary-<i>", its first 8 bytes big-endian / 2^64 < rate."""
    key = hashlib.sha256(f"clipd-audit-draws/{seed}".encode()).digest()
    values = [int.from_bytes(hmac.new(key, b"\0".join([b"clipd-draw/1", ledger.encode(), str(release).encode(),
                                                         f"canary-{i}".encode()]), hashlib.sha256).digest()[:8],
                             "big") / 2 ** 64 for i in range(2 * CANARIES)]
    return np.array(values) < rate


def independent_scores(seed, released, raw, stddevs, bounds, rate=1.0, policy="global", unit="example",
                       drawn_by=None, grid_step=0.0, participation=None):
    """Each canary's score over independent releases: the sum over every release of the log-likelihood ratio of
    a canary drawn with probability q against an absent one, log(1 - q + q exp((c y - c^2 / 2) / sigma^2)), y its
    projection on the release with the held-in canaries that were drawn put back; c the norm of its correct
    clip at the release's bound (``bounds``: one per release, or one for all). ``drawn_by``: a callable
    (release -> drawn) for a server-drawn ledger. ``participation``: (b, k) limits: each canary in k releases
    b apart from its start (drawn from the seed), scored on those only."""
    layout = canaries_of(seed)
    held_in = np.arange(2 * CANARIES) < CANARIES
    scores = np.zeros(2 * CANARIES)
    if np.ndim(bounds) == 0:
        bounds = [bounds] * len(released)
    for r, (out, total, sigma, bound) in enumerate(zip(released, raw, stddevs, bounds), start=1):
        scored = np.ones(2 * CANARIES, bool)
        if participation is not None:
            b, k = participation
            since = (r - 1) - np.random.default_rng([seed, 1]).integers(0, b, size=2 * CANARIES)
            drawn = scored = (since >= 0) & (since % b == 0) & (since // b < k)
        elif drawn_by is not None:
            drawn = drawn_by(r)
        elif rate >= 1:
            drawn = np.ones(2 * CANARIES, bool)
        else:
            drawn = np.random.default_rng([seed, r]).random(2 * CANARIES) < rate
        clips = correct_clips(layout, bounds_of(policy, bound), unit, grid_step)
        c = np.linalg.norm(clips, axis=1)
        y = projections_of(clips, out, total, drawn & held_in)
        share = (c * y - c ** 2 / 2) / sigma ** 2
        scores += np.where(scored, share if rate >= 1 else np.log(1 - rate + rate * np.exp(share)), 0.0)
    return scores[:CANARIES], scores[CANARIES:]


def stream_scores(seed, released, raw, sigma, coefs, b, k, bound):
    """The same over a correlated stream: projections decorrelated by C, against each canary's participation
    (from release s_i every b releases, k of them) times its clip's norm, times C."""
    layout = canaries_of(seed)
    clips = correct_clips(layout, [bound])
    c = np.linalg.norm(clips, axis=1)
    starts = np.random.default_rng([seed, 1]).integers(0, b, size=2 * CANARIES)
    t = len(released)
    since = np.arange(t)[None, :] - starts[:, None]
    participation = ((since >= 0) & (since % b == 0) & (since // b < k)).astype(float)
    held_in = np.arange(2 * CANARIES) < CANARIES
    y = np.stack([projections_of(clips, out, total, (participation[:, r] > 0) & held_in)
                  for r, (out, total) in enumerate(zip(released, raw))])
    matrix = np.array([[coefs[i - j] if 0 <= i - j < len(coefs) else 0.0 for j in range(t)] for i in range(t)])
    signal, observed = (participation * c[:, None]) @ matrix.T, y.T @ matrix.T
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


def audit_independent(client, privacy: Privacy, releases: int, rate: float = 1.0, policy: str = "global",
                      unit: str = "example", rows: int = 4, close: bool = True):
    released, raw, fields = run_ledger(client, privacy, releases, policy, unit, rows)
    ledger = client.close_audit(privacy.ledger_id) if close else client.ledger(privacy.ledger_id)
    audit = ledger.audit
    assert audit.closed and audit.releases == releases and audit.epsilon_claimed == pytest.approx(ledger.epsilon)
    in_scores, out_scores = independent_scores(audit.seed, released, raw, [f.noise_stddev for f in fields],
                                               [f.bound for f in fields], rate, policy, unit,
                                               grid_step=fields[0].grid_step)
    assert_server_agrees(audit, in_scores, out_scores)
    audit_independent.last = (released, raw)
    return audit


SOUND = {  # case: (policy, releases, rate, aggregation's clip policy, unit, rows a client sends)
    "gaussian": (dict(noise_multiplier=4.0), 3, 1.0, "global", "example", 4),
    "poisson": (dict(noise_multiplier=1.5, sampling="poisson", sampling_rate=0.3), 4, 0.3, "global", "example", 4),
    "per_layer": (dict(noise_multiplier=3.0), 3, 1.0, "per_layer_uniform", "example", 4),
    "client_unit": (dict(noise_multiplier=3.0), 3, 1.0, "global", "client", 10),
    "per_layer_client_unit": (dict(noise_multiplier=3.0), 2, 1.0, "per_layer_uniform", "client", 10),
}


@pytest.mark.parametrize("seed", [11, 12])
@pytest.mark.parametrize("case", [*SOUND, "secure"])
def test_a_sound_mechanism_is_not_refuted(client, case, seed):
    """Sound ledgers, each case with two seeds (two runs of its noise and canaries): the server's scores are
    the ones computed here, and the bound stays below the claim."""
    if case == "secure":  # secure noise draws from a CSPRNG only: no seed; the two runs are two draws
        audit = audit_independent(client, gaussian(3.0, noise="secure", accountant="zcdp"), 2)
    else:
        more, releases, rate, policy, unit, rows = SOUND[case]
        z = more.pop("noise_multiplier") if "noise_multiplier" in (more := dict(more)) else None
        audit = audit_independent(client, gaussian(z, seed=seed, **more), releases, rate, policy, unit, rows)
    assert 0 <= audit.epsilon_lower < audit.epsilon_claimed and not audit.refuted


def test_a_server_drawn_ledger_is_audited_with_canaries_the_server_draws(auth_server):
    """Poisson sampling the server draws (q = 0.3, unit client, credentials): the canaries are drawn as clients
    are, by the server's keyed function (under the audit's key, revealed with its seed), and scored without the
    draws; the sound ledger is not refuted."""
    privacy = gaussian(2.0, seed=13, sampling="poisson", sampling_rate=0.3, drawn_by="server")
    with Client(f"127.0.0.1:{auth_server.port}", token=ADMIN_TOKEN) as admin:
        released, raw, fields = run_ledger(admin, privacy, 4, unit="client", rows=10)
        audit = admin.close_audit(privacy.ledger_id).audit
    assert {f.sampling_drawn_by for f in fields} == {"server"}
    in_scores, out_scores = independent_scores(audit.seed, released, raw, [f.noise_stddev for f in fields], CLIP,
                                               0.3, unit="client",
                                               drawn_by=lambda r: server_draws(audit.seed, privacy.ledger_id, r, 0.3))
    assert_server_agrees(audit, in_scores, out_scores)
    assert not audit.refuted and audit.epsilon_lower < audit.epsilon_claimed


def test_a_participation_limited_ledger_is_audited_on_each_canarys_own_releases(auth_server):
    """Independent noise with participation limits (b = 2, k = 2, unit client): each canary takes part as a client
    may (k releases b apart from a start drawn from the seed) and is scored on those releases (the claim, k
    Gaussians, does not rest on their being secret); the sound ledger is not refuted."""
    privacy = gaussian(3.0, seed=14, min_separation=2, max_participations=2)
    with Client(f"127.0.0.1:{auth_server.port}", token=ADMIN_TOKEN) as admin:
        released, raw, fields = run_ledger(admin, privacy, 5, unit="client", rows=10)
        audit = admin.close_audit(privacy.ledger_id).audit
    in_scores, out_scores = independent_scores(audit.seed, released, raw, [f.noise_stddev for f in fields], CLIP,
                                               unit="client", participation=(2, 2))
    assert_server_agrees(audit, in_scores, out_scores)
    assert not audit.refuted and audit.epsilon_lower < audit.epsilon_claimed


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
    clips = correct_clips(canaries_of(audit.seed), [CLIP])
    c = np.linalg.norm(clips, axis=1)
    held_in = np.arange(2 * CANARIES) < CANARIES
    for r, (out, total) in enumerate(zip(released, raw), start=1):
        drawn = np.random.default_rng([audit.seed, r]).random(2 * CANARIES) < rate
        y = projections_of(clips, out, total, drawn & held_in)
        with_the_secret += np.where(drawn, (c * y - c ** 2 / 2) / (1.5 * CLIP) ** 2, 0.0)
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


@pytest.fixture()
def recompiled():
    """A test that patches a function the step programs trace: they are traced again while it lasts, and after
    (the accumulator's steps only: the noise's programs stay compiled)."""
    steps = (_accumulator._accumulate_jit, _accumulator._measure_jit)
    for step in steps:
        step.clear_cache()
    yield
    for step in steps:
        step.clear_cache()


def _multiplier_at_ten_times(real):
    return lambda norm, bound, rescale: real(norm, bound * 10, rescale)


def _layer_left_unclipped(real, layer):
    def clip_norms(squared, per_layer):
        norms = real(squared, per_layer)
        return norms.at[layer].set(0.0) if per_layer else norms  # a norm of 0 is never clipped
    return clip_norms


@pytest.mark.parametrize("break_", ["multiplier_at_10C", "layer_w_unclipped", "layer_b_unclipped",
                                    "client_rows_clipped_each"])
def test_a_broken_clip_is_refuted(memory_server, monkeypatch, recompiled, capsys, break_):
    """The clip broken inside the server: every contribution bounded at 10 C (one line of ``multiplier``); one
    layer of a per-layer policy left unclipped (its norm read as 0), the large one or the small one (which only
    some canaries reach); under the client unit, each of a client's rows clipped instead of their sum (a
    client of 10 rows moves the sum by up to 10 C). Each ledger claims less than the audit's ceiling, and
    `clipd audit` refutes it (exit 3). The data's scores are computed here as a sound server's would be: the
    canaries' excess over their correct clips is what the audit sees."""
    policy, unit, rows, z = "global", "example", 4, 10.0
    if break_ == "multiplier_at_10C":
        monkeypatch.setattr(_accumulator, "multiplier", _multiplier_at_ten_times(_accumulator.multiplier))
    elif break_.startswith("layer_"):
        policy = "per_layer_uniform"
        layer = 0 if break_ == "layer_w_unclipped" else 1
        z = 10.0 if layer == 0 else 20.0  # the small layer's canaries are fewer: a lower claim shows it
        monkeypatch.setattr(_accumulator, "_clip_norms", _layer_left_unclipped(_accumulator._clip_norms, layer))
    else:
        unit, rows = "client", 10
        monkeypatch.setattr(_unit, "client_contribution", lambda layers, clients=None: list(layers))
    # A fixed run (the audit is random: of 12 seeds, all refuted each break but the client case's, 10 of 12)
    privacy = gaussian(z, seed=18, ledger=f"clip-broken-{break_}-18")
    with Client(f"127.0.0.1:{memory_server.port}") as c:
        run_ledger(c, privacy, 3, policy, unit, rows)
        ledger = c.ledger(privacy.ledger_id)
    claimed = ledger.epsilon
    assert claimed < ledger.audit.epsilon_ceiling
    capsys.readouterr()
    assert cli.main(["audit", privacy.ledger_id, "--target", f"127.0.0.1:{memory_server.port}"]) == cli.EXIT_REFUTED
    last = capsys.readouterr().out.strip().splitlines()[-1]
    lower = float(last.split("epsilon_lower=")[1].split()[0])
    assert lower > claimed and last.startswith(f"audit: ledger={privacy.ledger_id} canaries={CANARIES} ")


@pytest.mark.parametrize("break_", [None, "multiplier_at_10C"])
def test_a_large_models_path_is_audited_as_its_data_goes(monkeypatch, recompiled, break_):
    """A server whose steps take one row (a large model's path: each example measured on the device and added
    into the float64 totals on the host): the canaries go one a step too, and are scored as the data is; a clip
    at 10 C is refuted there as well."""
    if break_:
        monkeypatch.setattr(_accumulator, "multiplier", _multiplier_at_ten_times(_accumulator.multiplier))
    server, _ = create_server(Settings(**{**TEST_SETTINGS, "max_device_rows": 1}))
    try:
        with Client(f"127.0.0.1:{server.port}") as c:
            aggregation = server.lifecycle.registry.get(c.create_aggregation(LAYERS, l2_norm_clip=CLIP))
            assert aggregation.device_rows == 1 and aggregation.sums_on_host(jax.default_backend())
            audit = audit_independent(c, gaussian(10.0, seed=23, ledger=f"one-a-step-{break_}"), 3)
    finally:
        server.stop(grace=1.0)
    assert audit.refuted == (break_ is not None)


def test_an_audited_release_is_the_unaudited_one(client):
    """Same seed, same data: the release with canaries in and taken out is the release without them, to float
    rounding (each canary goes in as the clip makes it, in float32, and comes out as the correct clip,
    computed in float64)."""
    audited = gaussian(2.0, seed=99)
    plain = Privacy(new_ledger(), DELTA, noise_multiplier=2.0, seed=99)
    with_canaries, _, _ = run_ledger(client, audited, 2)
    without, _, _ = run_ledger(client, plain, 2)
    for a, b in zip(with_canaries, without):
        assert np.max(np.abs(a - b)) / np.max(np.abs(b)) <= 1e-6
        assert np.count_nonzero(a != b) <= 2 * CANARIES + SIZES[1]  # only the canaries' coordinates may differ


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
BLT = dict(mechanism="blt", releases=6, min_separation=2, max_participations=3, buffers=2,
           declared_participation=True)  # (the plan tests/test_client_unit.py optimizes too: done once)


@pytest.mark.parametrize("break_", [None, "noise_10x_too_small", "identity_stream", "blt"])
def test_a_stream_is_audited_on_its_decorrelated_releases(client, monkeypatch, break_):
    """A banded (or BLT) stream's audit closes by itself with its last release. Sound: not refuted. Its noise a
    tenth: refuted. C^-1 replaced by the identity (independent noise of the stream's sigma per release): not
    seen, and rightly: for a participant in k releases b apart that is a Gaussian mechanism of sqrt(k) c /
    sigma, no more than sens(C) c / sigma, the claim."""
    real_step = CorrelatedNoise.step
    if break_ == "noise_10x_too_small":
        monkeypatch.setattr(CorrelatedNoise, "step", lambda self, z, state: real_step(self, z, state) / 10)
    elif break_ == "identity_stream":
        monkeypatch.setattr(CorrelatedNoise, "step", lambda self, z, state: np.asarray(z, np.float64))
    stream = BLT if break_ == "blt" else STREAM
    privacy = Privacy(new_ledger(), DELTA, noise_multiplier=3.0, seed=21, audit=Audit(canaries=CANARIES), **stream)
    released, raw, fields = run_ledger(client, privacy, stream["releases"])
    ledger = client.ledger(privacy.ledger_id)
    audit = ledger.audit
    assert audit.closed and audit.releases == 6 and audit.epsilon_claimed == pytest.approx(ledger.epsilon)
    strategy = list(ledger.stream.strategy)
    if break_ == "blt":  # C's coefficients from the BLT's decays and scales: 1, then sum_i omega_i theta_i^(t-1)
        half = len(strategy) // 2
        theta, omega = np.array(strategy[:half]), np.array(strategy[half:])
        strategy = [1.0] + [float(np.sum(omega * theta ** (t - 1))) for t in range(1, 6)]
    in_scores, out_scores = stream_scores(audit.seed, released, raw, fields[0].stream_noise_stddev, strategy, 2, 3,
                                          fields[0].bound)
    assert_server_agrees(audit, in_scores, out_scores)
    assert audit.refuted == (break_ == "noise_10x_too_small")
    if break_ == "identity_stream":
        assert math.sqrt(3) <= fields[0].sensitivity / fields[0].bound * (1 + 1e-9)  # sens(C) >= sqrt(k)


def test_a_streams_audit_state_does_not_grow_with_its_releases(memory_server, client):
    """A stream's audit keeps the strategy's memory of each canary's projections and two running sums: the same
    bytes after its first release as after its fifth (its sixth, the last, closes it with its scores)."""
    privacy = Privacy(new_ledger(), DELTA, noise_multiplier=3.0, seed=22, audit=Audit(canaries=CANARIES), **STREAM)
    sizes = []
    for r in range(STREAM["releases"] - 1):
        run_ledger(client, privacy, 1)
        if r in (0, 4):
            sizes.append(len(memory_server.store.ledger_audit(privacy.ledger_id)))
    assert sizes[0] == sizes[1] < 2 * CANARIES * 8 * (2 * 1 + 2 + 1) + 4096  # (bands - 1 = 1 row of each memory)


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


def test_an_audit_of_the_format_before_reads_and_closes_over_the_releases_it_has():
    """A ledger audited by a version whose canaries went beside the clip (format CLIPDAU1: every release's
    projections kept): it takes no more releases and closes over the ones it has, a stream's scored with its
    projections decorrelated by C (computed here with the whole matrix)."""
    from clipd.engine import _container
    from clipd.server.audit import LEGACY_AUDIT_MAGIC, AuditState

    n, t = 50, 4
    rng = np.random.default_rng(5)
    projections, magnitudes = rng.normal(size=(t, 2 * n)), np.full(2 * n, 0.8)
    header = {"seed": 9, "canaries": n, "confidence": 0.95, "releases": t, "result": None}
    blob = _container.to_bytes(LEGACY_AUDIT_MAGIC, header, [("scores", np.zeros(2 * n)),
                                                            ("projections", projections), ("magnitudes", magnitudes)])
    state = AuditState.from_bytes(blob)
    assert not state.closed and not state.takes_releases
    stream = CorrelatedNoise("banded", releases=6, min_separation=2, max_participations=3, strategy=(0.9, 0.4))
    state.close(DELTA, stream, 2.0, claimed=3.0)
    starts = np.random.default_rng([9, 1]).integers(0, 2, size=2 * n)
    since = np.arange(t)[None, :] - starts[:, None]
    participation = ((since >= 0) & (since % 2 == 0) & (since // 2 < 3)).astype(float)
    matrix = np.array([[[0.9, 0.4][i - j] if 0 <= i - j < 2 else 0.0 for j in range(t)] for i in range(t)])
    signal, observed = (participation * 0.8) @ matrix.T, projections.T @ matrix.T
    expected = ((signal * observed).sum(1) - (signal ** 2).sum(1) / 2) / 4.0
    np.testing.assert_allclose(state.result["in_scores"] + state.result["out_scores"], expected, rtol=1e-12)
    assert AuditState.from_bytes(state.to_bytes()).closed  # (kept in this format once closed)
