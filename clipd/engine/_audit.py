"""Canary audits: an empirical lower bound on a ledger's epsilon (pure functions; the server keeps the state).

An audit of ``N`` canaries draws ``2N`` canaries from a secret seed: the first ``N`` are *held in* (they take
part in the releases they are drawn for, as one more unit of the ledger), the other ``N`` *held out* (drawn the
same way, never added). A canary is a contribution, and it goes where the data goes: its vector is clipped by
the aggregation's own clip (its policy's bounds, global or per layer, and its unit) and summed by the same
step as the data, before the noise. After the noise the server takes out what a *correct* clip of each canary
would have added, computed here from the canary's known vector and the bound (:func:`clipped_as_specified`),
never by the clipping code under audit. A sound server's releases are then unchanged (post-processing: no cost
in privacy); a clip that lets a canary through at more than its bound leaves the excess in the release, and
the canaries' scores see it. Each canary's norm is 10^3 to 10^4 times its bound, as Andrew et al. (ICLR 2024)
make their canary clients, so only a working clip brings it back to the bound.

**The canaries** (:func:`canary_layout`, from ``default_rng([seed, 0])``, in this order):

- ``order = permutation(2N)``; then for each layer ``k`` in turn, ``m_k = min(2N, D_k)`` canaries get a
  coordinate of their own in it: the next ``m_k`` canaries of ``order`` (cyclically, each layer starting where
  the last one ended), at ``choice(D_k, m_k, replace=False)``, with signs ``2 * integers(0, 2, m_k) - 1``. A
  canary has at most one coordinate per layer, and no two canaries share one, so the canaries are orthogonal:
  under noise that is independent across coordinates, their scores are independent trials. Every canary has
  a coordinate in every layer of at least ``2N`` parameters; a smaller layer hosts ``D_k`` of them (needs
  ``2N <= D`` in all);
- ``factors = 10 ** uniform(3, 4, 2N)``: how far past its bound each canary reaches;
- ``rows = integers(2, 9, 2N)`` and ``weights = uniform(0.5, 1.5, sum(rows))``: a client-unit canary is a
  client that sends ``rows_i`` rows, row ``r`` its vector times ``weights_r / sum(its weights)``.

Canary ``i``'s value in layer ``k`` (:func:`canary_vectors`) is ``sign * factor_i * s_k``, ``s_k`` the layer's bound
under a per-layer policy, else ``C / sqrt(K_i)`` (``K_i``: the layers it has a coordinate in), so its norm is
``factor_i`` times the bound, layer by layer or over its whole vector; capped well inside the layer's dtype;
held in its layer's dtype. Under the example unit that is its one row; under the client unit each of its rows
is that times its weight, in the layer's dtype, and its vector is their sum (in float64, held in the dtype) as
the client unit sums a client's rows.

**Which releases** draw a canary follows the ledger's rules for a unit:

- independent noise, no sampling: every release; Poisson sampling at rate ``q`` drawn by the caller
  (fixed-size sampling: ``q = sample_size / population``): release ``r`` iff ``U_{r,i} < q``, ``U_r =
  default_rng([seed, r]).random(2N)``; drawn by the server: the server's keyed draw (``engine._sampling``) of
  the identity ``canary-<i>`` under the key ``sha256("clipd-audit-draws/<seed>")``;
- a correlated stream of (n, b, k): the releases ``s_i, s_i + b, ...`` (``k`` of them, up to n), ``s_i`` drawn
  in ``[0, b)`` (:func:`stream_starts`): a participation the stream's accounting covers.

**Scores.** A correct clip adds ``e_i`` (:func:`clipped_as_specified`), of norm ``c_i``. The server scores
canary ``i`` by its projection on the direction of ``e_i``, ``y_{r,i} = <e_i / c_i, release_r - raw_r>`` (the
release as noised, canaries in; the raw sum without them: the auditor knows every contribution but the
canaries, the noise and the sampling, the adversary differential privacy is about). The score is the
log-likelihood ratio of "held in" against "held out" under the noise the ledger claims: for independent noise
of stddev ``sigma_r`` per coordinate and a sampling rate ``q``,

    score_i = sum over every release r of log(1 - q + q exp((c_i * y_{r,i} - c_i^2 / 2) / sigma_r^2))

(without sampling, ``q = 1``: the sum of ``(c y - c^2 / 2) / sigma^2``; the releases that drew a canary are not
used: the claim's amplification by sampling rests on their being secret), and for a correlated stream (noise
``sigma * C^-1 Z``), the same of the decorrelated releases ``C y``, summed release by release
(:class:`StreamScoring`: ``O(N)`` state, the strategy's memory of each canary's projections):

    score_i = (<C p_i, C y_i> - ||C p_i||^2 / 2) / sigma^2,   p_i = c_i * (its participation, 0 or 1 per release)

A sound mechanism gives held-in scores ``N(mu, mu)`` and held-out ``N(-mu, mu)`` in distribution, ``mu`` what the
claimed epsilon allows; too little noise, or a clip past the bound, separates them further.
``jax_privacy.auditing.CanaryScoreAuditor`` turns the two samples into a lower bound on epsilon at a confidence
(Clopper-Pearson on the attack's error rates, Bonferroni over its thresholds). With N canaries it can certify
at most :func:`epsilon_ceiling`.

>>> layout = canary_layout(seed=7, canaries=2, sizes=[10, 3])
>>> [m.tolist() for m in layout.members], layout.held_in.tolist()
([[0, 2, 1, 3], [0, 2, 1]], [True, True, False, False])
>>> sorted(set(layout.positions[0].tolist())) == sorted(layout.positions[0].tolist())  # a coordinate each
True
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Sequence

import numpy as np

from ._correlated import BandedToeplitz, Blt, strategy_step

DEFAULT_CONFIDENCE = 0.95
FACTORS = (3.0, 4.0)  # a canary's norm is 10^3 to 10^4 times its bound (log-uniform)
CLIENT_ROWS = (2, 8)  # a client-unit canary sends 2 to 8 rows


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
    """Where an audit's ``2N`` canaries are (the first ``canaries`` held in, the rest held out), how far past
    their bound they reach, and how a client-unit canary splits into rows."""

    canaries: int  # N
    members: tuple[np.ndarray, ...]  # per layer: int64 (m_k,): the canaries with a coordinate in it
    positions: tuple[np.ndarray, ...]  # per layer: int64 (m_k,): that coordinate (flat, in the layer)
    signs: tuple[np.ndarray, ...]  # per layer: float64 (m_k,): +1 or -1
    factors: np.ndarray  # float64 (2N,): norm / bound
    rows: np.ndarray  # int64 (2N,): a client-unit canary's rows
    weights: np.ndarray  # float64 (sum(rows),): each canary's rows' shares, canary after canary (each sums to 1)
    starts: np.ndarray  # int64 (2N,): a correlated stream's first release of each canary (0-based), in [0, b)

    @property
    def count(self) -> int:
        return 2 * self.canaries

    @property
    def held_in(self) -> np.ndarray:
        """bool (2N,): which canaries are added to the releases."""
        return np.arange(self.count) < self.canaries

    @property
    def layers_of(self) -> np.ndarray:
        """int64 (2N,): how many layers each canary has a coordinate in."""
        return sum((np.bincount(m, minlength=self.count) for m in self.members), np.zeros(self.count, np.int64))

    @property
    def row_starts(self) -> np.ndarray:
        """int64 (2N,): where each canary's rows start in ``weights``."""
        return np.concatenate([[0], np.cumsum(self.rows)[:-1]]).astype(np.int64)


def canary_layout(seed: int, canaries: int, sizes: Sequence[int], min_separation: int = 1) -> CanaryLayout:
    """The canaries of an audit in a model of layers of ``sizes`` parameters (see the module for the recipe).
    ``ValueError`` if the model has fewer than ``2N`` coordinates."""
    check_canaries(canaries, sum(sizes))
    count = 2 * canaries
    rng = np.random.default_rng([seed, 0])
    order = rng.permutation(count)
    members, positions, signs, offset = [], [], [], 0
    for size in sizes:
        m = min(count, int(size))
        members.append(order[(offset + np.arange(m)) % count].astype(np.int64))
        positions.append(rng.choice(int(size), size=m, replace=False).astype(np.int64))
        signs.append(rng.integers(0, 2, size=m).astype(np.float64) * 2 - 1)
        offset = (offset + m) % count
    factors = 10.0 ** rng.uniform(*FACTORS, size=count)
    rows = rng.integers(CLIENT_ROWS[0], CLIENT_ROWS[1] + 1, size=count).astype(np.int64)
    weights = rng.uniform(0.5, 1.5, size=int(rows.sum()))
    starts = np.concatenate([[0], np.cumsum(rows)[:-1]])
    weights /= np.repeat(np.add.reduceat(weights, starts), rows)
    return CanaryLayout(canaries, tuple(members), tuple(positions), tuple(signs), factors, rows, weights,
                        stream_starts(seed, canaries, min_separation))


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


def layer_bounds(kind: str, bound: float, sizes: Sequence[int], explicit: Sequence[float] = ()) -> tuple[float, ...]:
    """The bound of each layer as the policy states it (the design's table), written here so that an audit does
    not take it from the clipping code it audits: ``(C,)`` for ``global``; ``C / sqrt(K)``
    (``per_layer_uniform``), ``C sqrt(D_k / D)`` (``per_layer_proportional``) or the explicit ``C_k``.

    >>> layer_bounds("per_layer_proportional", 2.0, [3, 1])
    (1.7320508075688772, 1.0)
    """
    if kind == "global":
        return (float(bound),)
    if kind == "per_layer_uniform":
        return tuple(float(bound) / math.sqrt(len(sizes)) for _ in sizes)
    if kind == "per_layer_proportional":
        total = float(sum(sizes))
        return tuple(float(bound) * math.sqrt(size / total) for size in sizes)
    if kind == "per_layer_explicit":
        return tuple(float(c) for c in explicit)
    raise ValueError(f"unknown clip policy kind {kind!r}")


@dataclasses.dataclass(frozen=True)
class CanaryVectors:
    """Every canary's data at one release's bounds: its rows as its client sends them and its vector."""

    rows: tuple[np.ndarray, ...]  # per layer: (m_k, max rows) in the layer's dtype, zeros past a canary's rows
    values: tuple[np.ndarray, ...]  # per layer: float64 (m_k,): each member's vector there (its rows' sum)


def canary_vectors(layout: CanaryLayout, bounds: Sequence[float], dtypes: Sequence, client_unit: bool
                   ) -> CanaryVectors:
    """The canaries' rows and vectors for layers of ``dtypes`` whose bounds are ``bounds`` (one: a global
    bound; else one per layer). Example unit: one row each, its value ``sign * factor * s_k`` held in the dtype;
    client unit: ``rows_i`` rows of that times each weight, and the vector their float64 sum held in the dtype.

    >>> layout = canary_layout(seed=1, canaries=1, sizes=[2, 2])
    >>> vectors = canary_vectors(layout, [1.0], [np.float32, np.float32], client_unit=False)
    >>> norms = np.sqrt(sum(np.bincount(m, v ** 2, 2) for m, v in zip(layout.members, vectors.values)))
    >>> np.allclose(norms, layout.factors)  # factor times the global bound
    True
    """
    per_layer = len(bounds) > 1
    spread = np.sqrt(np.maximum(layout.layers_of, 1).astype(np.float64))
    most = int(layout.rows.max()) if client_unit else 1
    starts, rows_out, values_out = layout.row_starts, [], []
    for k, (members, signs, dtype) in enumerate(zip(layout.members, layout.signs, dtypes)):
        dtype = np.dtype(dtype)
        scale = bounds[k] if per_layer else bounds[0] / spread[members]
        base = np.clip(signs * layout.factors[members] * scale, -_cap(dtype, len(layout.members)),
                       _cap(dtype, len(layout.members)))
        if not client_unit:
            rows = base.astype(dtype)[:, None]
        else:
            share = np.zeros((members.size, most))
            for r in range(most):
                has = r < layout.rows[members]
                share[has, r] = layout.weights[starts[members[has]] + r]
            rows = (base[:, None] * share).astype(dtype)
        rows_out.append(rows)
        values_out.append(np.sum(rows, axis=1, dtype=np.float64).astype(dtype).astype(np.float64))
    return CanaryVectors(tuple(rows_out), tuple(values_out))


def _cap(dtype: np.dtype, layers: int) -> float:
    """The largest canary value for a layer of ``dtype``: far inside it, and its square (summed over the layers
    in the compute dtype, float32 at least) far inside that."""
    compute = np.float64 if dtype == np.float64 else np.float32
    return min(float(np.finfo(dtype).max) / 16, math.sqrt(float(np.finfo(compute).max) / max(1, layers)) / 16)


def clipped_as_specified(layout: CanaryLayout, values: Sequence[np.ndarray], bounds: Sequence[float],
                         grid_step: float = 0.0) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """What a correct clip adds for each canary (float64, per layer, per member) and its norm ``c_i`` (2N,):
    the vector times ``min(1, C / ||v||)`` over its whole vector (one bound), or each layer's part times
    ``min(1, C_k / ||v_k||)`` (per layer); on a secure grid of step ``g``, rounded to it (the release stays on
    its grid). Computed from the canaries' known vectors and the bounds, in float64.

    >>> layout = canary_layout(seed=1, canaries=1, sizes=[2, 2])
    >>> vectors = canary_vectors(layout, [1.0], [np.float32, np.float32], client_unit=False)
    >>> added, norms = clipped_as_specified(layout, vectors.values, [1.0])
    >>> np.round(norms, 6).tolist()
    [1.0, 1.0]
    """
    count = layout.count
    if len(bounds) == 1:
        norms = np.sqrt(sum((np.bincount(m, v ** 2, count) for m, v in zip(layout.members, values)),
                            np.zeros(count)))
        with np.errstate(divide="ignore"):
            scale = np.minimum(1.0, np.where(norms > 0, bounds[0] / norms, 1.0))
        added = [v * scale[m] for m, v in zip(layout.members, values)]
    else:
        added = [np.sign(v) * np.minimum(np.abs(v), c) for v, c in zip(values, bounds)]
    if grid_step > 0:
        added = [np.rint(a / grid_step) * grid_step for a in added]
    magnitudes = np.sqrt(sum((np.bincount(m, a ** 2, count) for m, a in zip(layout.members, added)),
                             np.zeros(count)))
    return tuple(added), magnitudes


def projections(layout: CanaryLayout, seen: Sequence[np.ndarray], added: Sequence[np.ndarray],
                magnitudes: np.ndarray) -> np.ndarray:
    """float64 (2N,): each canary's projection ``<e_i / c_i, d_i>`` on what the release shows at its coordinates
    beyond the raw sum (``seen``: per layer, per member, ``release - raw``), ``e_i`` its correct clip (0 where
    ``c_i`` is 0)."""
    count = layout.count
    dot = sum((np.bincount(m, a * d, count) for m, a, d in zip(layout.members, added, seen)), np.zeros(count))
    return np.divide(dot, magnitudes, out=np.zeros(count), where=magnitudes > 0)


def drawn_for_release(seed: int, release: int, count: int, rate: float) -> np.ndarray:
    """bool (count,): the canaries drawn for independent release ``release`` (1-based) at sampling rate ``rate``
    (1: every release), when the caller draws the sample.

    >>> drawn_for_release(7, 3, 4, 1.0).tolist()
    [True, True, True, True]
    """
    if rate >= 1.0:
        return np.ones(count, bool)
    return np.random.default_rng([seed, release]).random(count) < rate


def draw_key(seed: int) -> bytes:
    """The key of a server-drawn ledger's canary draws (``engine._sampling``): ``sha256("clipd-audit-draws/<seed>")``,
    revealed with the seed when the audit closes (the ledger's own key never is)."""
    return hashlib.sha256(f"clipd-audit-draws/{seed}".encode()).digest()


def canary_identities(count: int) -> list[str]:
    """The identities a server-drawn ledger's canaries are drawn as: ``canary-0``, ``canary-1``, ... (under the
    audit's key, :func:`draw_key`: a client named so is drawn under the ledger's, independently)."""
    return [f"canary-{i}" for i in range(count)]


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


def stream_participation(starts: np.ndarray, release: int, min_separation: int, max_participations: int
                         ) -> np.ndarray:
    """float64 (2N,): 1 where a canary takes part in a stream's release ``release`` (0-based), else 0.

    >>> [stream_participation(np.array([0, 1]), t, 2, 2).tolist() for t in range(5)]
    [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]
    """
    since = release - starts
    return ((since >= 0) & (since % min_separation == 0) & (since // min_separation < max_participations)
            ).astype(np.float64)


@dataclasses.dataclass
class StreamScoring:
    """A correlated stream's canary scores, one release at a time, in ``O(N)``: the strategy's memory
    (:func:`~clipd.engine._correlated.strategy_step`) of each canary's projections ``y`` and signal ``p``, and the
    running sums ``sum_t (C p)_t (C y)_t`` and ``sum_t (C p)_t^2``.

    >>> scoring = StreamScoring.new(rows=0, count=2)
    >>> scoring.add(BandedToeplitz((1.0,)), np.array([1.0, 0.0]), np.array([1.0, 0.0]))  # C = I
    >>> scoring.scores(1.0).tolist()  # one release: the independent score
    [0.5, 0.0]
    """

    observed: np.ndarray  # (rows, 2N)
    signal: np.ndarray  # (rows, 2N)
    dot: np.ndarray  # (2N,)
    square: np.ndarray  # (2N,)

    @classmethod
    def new(cls, rows: int, count: int) -> StreamScoring:
        return cls(np.zeros((rows, count)), np.zeros((rows, count)), np.zeros(count), np.zeros(count))

    def add(self, strategy: Blt | BandedToeplitz, projections: np.ndarray, signal: np.ndarray) -> None:
        """The next release: each canary's projection on it and its signal there (``c_i`` times its
        participation)."""
        observed = strategy_step(projections, self.observed, strategy)
        expected = strategy_step(signal, self.signal, strategy)
        self.dot += expected * observed
        self.square += expected ** 2

    def scores(self, sigma: float) -> np.ndarray:
        return (self.dot - self.square / 2) / sigma ** 2


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
