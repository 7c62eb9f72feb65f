"""Canary audits: an empirical lower bound on a ledger's epsilon (pure functions; the server keeps the state).

An audit of ``N`` canaries draws ``2N`` canaries from a secret seed: the first ``N`` are *held in* (added to the
releases they are drawn for, as one more unit of the ledger), the other ``N`` *held out* (drawn the same way,
never added). Canary ``i`` is ``sign_i * c * e_{j_i}``: one coordinate ``j_i`` of the flattened model (the
layers in order, each in C order), all ``2N`` coordinates distinct, a random sign, and the norm ``c`` of one
unit's clipped contribution (the release's bound; under a per-layer policy the smallest layer bound; on a secure
grid rounded down to the grid). Distinct coordinates make the canaries orthogonal: under any noise that is
i.i.d. across coordinates, the canaries' scores are independent draws, so held-in and held-out scores are two
samples of independent trials (Clopper-Pearson's setting), and the audit costs O(N) per release whatever the
model's size.

Which releases a canary is drawn for follows the ledger's rules for a unit:

- independent noise, no sampling: every release; Poisson sampling at rate ``q`` (fixed-size sampling: ``q =
  sample_size / population``): release ``r`` iff ``U_{r,i} < q``, ``U_r = default_rng([seed, r]).random(2N)``;
- a correlated stream of (n, b, k): the releases ``s_i, s_i + b, ...`` (``k`` of them, up to n), ``s_i`` drawn
  in ``[0, b)`` (:func:`stream_starts`): a participation the stream's accounting covers.

The server scores canary ``i`` by its projection ``y_{r,i} = sign_i * (release_r[j_i] - raw_r[j_i])`` on each
release (the release as noised, canaries in; the raw sum without them: the auditor knows every contribution but
the canaries, the noise and the sampling, the adversary differential privacy is about). The score is the
log-likelihood ratio of "held in" against "held out" under the noise the ledger claims: for independent noise
of stddev ``sigma_r`` per coordinate and a sampling rate ``q``,

    score_i = sum over every release r of log(1 - q + q exp((c_i * y_{r,i} - c_i^2 / 2) / sigma_r^2))

(without sampling, ``q = 1``: the sum of ``(c y - c^2 / 2) / sigma^2``; the releases that drew a canary are not
used: the claim's amplification by sampling rests on their being secret)

and for a correlated stream (noise ``sigma * C^-1 Z``), the same of the decorrelated releases ``C y``:

    score_i = (<C p_i, C y_i> - ||C p_i||^2 / 2) / sigma^2,   p_i = c_i * (its participation, 0 or 1 per release)

A sound mechanism gives held-in scores ``N(mu, mu)`` and held-out ``N(-mu, mu)`` in distribution, ``mu`` what the
claimed epsilon allows; too little noise separates them further. ``jax_privacy.auditing.CanaryScoreAuditor``
turns the two samples into a lower bound on epsilon at a confidence (Clopper-Pearson on the attack's error
rates, Bonferroni over its thresholds). With N canaries it can certify at most :func:`epsilon_ceiling`.

>>> layout = canary_layout(seed=7, canaries=2, dimension=10)
>>> layout.coordinates.size, len(set(layout.coordinates.tolist())), set(np.abs(layout.signs).tolist())
(4, 4, {1.0})
>>> layout.held_in.tolist()
[True, True, False, False]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

DEFAULT_CONFIDENCE = 0.95


@dataclasses.dataclass(frozen=True)
class CanaryAudit:
    """A ledger's audit: ``canaries`` held in and as many held out; its bound holds with ``confidence``."""

    canaries: int
    confidence: float = DEFAULT_CONFIDENCE

    def __post_init__(self) -> None:
        if self.canaries < 1:
            raise ValueError(f"an audit needs at least 1 canary, got {self.canaries}")
        if not 0.5 < self.confidence < 1.0:
            raise ValueError(f"an audit's confidence must be in (0.5, 1), got {self.confidence}")


@dataclasses.dataclass(frozen=True)
class CanaryLayout:
    """Where an audit's ``2N`` canaries are: the first ``canaries`` held in, the rest held out."""

    canaries: int  # N
    coordinates: np.ndarray  # int64 (2N,): distinct flat coordinates of the model
    signs: np.ndarray  # float64 (2N,): +1 or -1
    starts: np.ndarray  # int64 (2N,): a correlated stream's first release of each canary (0-based), in [0, b)

    @property
    def held_in(self) -> np.ndarray:
        """bool (2N,): which canaries are added to the releases."""
        return np.arange(2 * self.canaries) < self.canaries


def canary_layout(seed: int, canaries: int, dimension: int, min_separation: int = 1) -> CanaryLayout:
    """The canaries of an audit: from ``default_rng([seed, 0])``, in this order, ``choice(dimension, 2N,
    replace=False)`` (the coordinates) and ``integers(0, 2, 2N)`` (sign ``2u - 1``); the stream's starts are
    :func:`stream_starts`. ``ValueError`` if the model has fewer than ``2N`` coordinates."""
    check_canaries(canaries, dimension)
    rng = np.random.default_rng([seed, 0])
    coordinates = rng.choice(dimension, size=2 * canaries, replace=False).astype(np.int64)
    signs = rng.integers(0, 2, size=2 * canaries).astype(np.float64) * 2 - 1
    return CanaryLayout(canaries, coordinates, signs, stream_starts(seed, canaries, min_separation))


def stream_starts(seed: int, canaries: int, min_separation: int) -> np.ndarray:
    """int64 (2N,): each canary's first release in a correlated stream (0-based), ``default_rng([seed,
    1]).integers(0, b, 2N)``."""
    return np.random.default_rng([seed, 1]).integers(0, max(1, min_separation), size=2 * canaries).astype(np.int64)


def check_canaries(canaries: int, dimension: int) -> None:
    """``ValueError`` unless ``1 <= 2 * canaries <= dimension`` (each canary has a coordinate of its own)."""
    if canaries < 1:
        raise ValueError(f"an audit needs at least 1 canary, got {canaries}")
    if 2 * canaries > dimension:
        raise ValueError(f"an audit of {canaries} canaries needs {2 * canaries} coordinates (one per canary, held in"
                         f" and held out); the model has {dimension}: at most {dimension // 2} canaries")


def drawn_for_release(seed: int, release: int, count: int, rate: float) -> np.ndarray:
    """bool (count,): the canaries drawn for independent release ``release`` (1-based) at sampling rate ``rate``
    (1: every release).

    >>> drawn_for_release(7, 3, 4, 1.0).tolist()
    [True, True, True, True]
    """
    if rate >= 1.0:
        return np.ones(count, bool)
    return np.random.default_rng([seed, release]).random(count) < rate


def magnitudes(coordinates: np.ndarray, layer_bounds: Sequence[float], grid_step: float = 0.0) -> np.ndarray:
    """float64 (2N,): each canary's norm: the smallest of the layers' bounds (one bound: it), so that a canary
    is within its layer's bound wherever it lands and held-in and held-out canaries are alike, rounded down to
    ``grid_step`` if there is one.

    >>> magnitudes(np.array([0, 3, 4]), [1.0, 0.5]).tolist()
    [0.5, 0.5, 0.5]
    >>> magnitudes(np.array([0]), [1.0], grid_step=0.3).tolist()
    [0.8999999999999999]
    """
    value = float(min(layer_bounds))
    if grid_step > 0:
        value = math.floor(value / grid_step) * grid_step
    return np.full(coordinates.shape, value)


def independent_scores(projections: np.ndarray, magnitudes: np.ndarray, rate: float, stddev: float) -> np.ndarray:
    """One independent release's share of each canary's score: the log-likelihood ratio of a canary that joins
    the release with probability ``q`` (its sampling rate; 1 without sampling) against one that is absent,
    ``log(1 - q + q exp((c y - c^2 / 2) / sigma^2))``. Every canary is scored on every release: which releases
    drew it is the mechanism's secret (the claimed epsilon's amplification by sampling assumes so).

    >>> independent_scores(np.array([1.0, 0.0]), np.array([1.0, 1.0]), 1.0, 1.0).tolist()
    [0.5, -0.5]
    >>> [round(float(v), 4) for v in independent_scores(np.array([1.0, 0.0]), np.array([1.0, 1.0]), 0.5, 1.0)]
    [0.2809, -0.2191]
    """
    share = (magnitudes * projections - magnitudes ** 2 / 2) / stddev ** 2
    if rate >= 1.0:
        return share
    return np.logaddexp(math.log1p(-rate), math.log(rate) + share)


def stream_participation(starts: np.ndarray, made: int, min_separation: int, max_participations: int) -> np.ndarray:
    """float64 (2N, made): 1 where a canary takes part in a stream's release (0-based), else 0.

    >>> stream_participation(np.array([0, 1]), 5, 2, 2).tolist()
    [[1.0, 0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 1.0, 0.0]]
    """
    release = np.arange(made)[None, :]
    since = release - starts[:, None]
    return ((since >= 0) & (since % min_separation == 0) & (since // min_separation < max_participations)
            ).astype(np.float64)


def stream_scores(projections: np.ndarray, magnitudes: np.ndarray, participation: np.ndarray,
                  coefs: np.ndarray, sigma: float) -> np.ndarray:
    """Each canary's score over a correlated stream's first ``t`` releases: ``projections`` (t, 2N), the
    participation (2N, t), the strategy's Toeplitz coefficients ``c_0 .. c_{t-1}``, the stream's sigma.

    >>> y = np.array([[1.0, 0.0]])  # one release, C = [1]: the independent score
    >>> stream_scores(y, np.ones(2), np.array([[1.0], [0.0]]), np.array([1.0]), 1.0).tolist()
    [0.5, 0.0]
    """
    t = projections.shape[0]
    lag = np.subtract.outer(np.arange(t), np.arange(t))  # i - j: C[i, j] = c_{i-j} on and below the diagonal
    c = np.where(lag >= 0, np.asarray(coefs, np.float64)[:t][np.clip(lag, 0, None)], 0.0)
    signal = (participation * magnitudes[:, None]) @ c.T  # rows: C p_i
    observed = projections.T @ c.T  # rows: C y_i
    return ((signal * observed).sum(axis=1) - (signal ** 2).sum(axis=1) / 2) / sigma ** 2


def epsilon_lower_bound(in_scores: np.ndarray, out_scores: np.ndarray, confidence: float, delta: float) -> float:
    """``CanaryScoreAuditor(in, out).epsilon_clopper_pearson(1 - confidence, delta)``: epsilon is at least this,
    with probability ``confidence``, if the scores are independent trials."""
    from jax_privacy.auditing import CanaryScoreAuditor  # its scipy import is paid by audits only

    bound = CanaryScoreAuditor(np.asarray(in_scores, np.float64), np.asarray(out_scores, np.float64)
                               ).epsilon_clopper_pearson(1 - confidence, delta)
    return 0.0 if math.isnan(bound) else float(bound)  # NaN (non-finite scores): nothing shown


@functools.lru_cache(maxsize=64)
def epsilon_ceiling(canaries: int, confidence: float, delta: float) -> float:
    """The most :func:`epsilon_lower_bound` can show with ``canaries`` held in and held out: its bound when every
    held-in score is above every held-out one.

    >>> round(epsilon_ceiling(100, 0.95, 1e-5), 2)
    3.02
    """
    return epsilon_lower_bound(np.ones(canaries), np.zeros(canaries), confidence, delta)
