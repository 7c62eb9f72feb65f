"""Correlated noise across releases (DP-FTRL by matrix factorization): strategies, their noise streams and
their sensitivity under participation with a minimum separation.

A ledger's releases x_0, x_1, ... are summed into a model: the workload is their prefix sums, A = tri(n).
Factor A = B C. The mechanism adds to release t the t-th row of

    w = sigma * C^{-1} Z,        Z: n rows of iid N(0, 1), each the model's size,

so the model (the prefix sums) carries B (C x + sigma Z): noise of one Gaussian mechanism on C x, whose rows
partly cancel in the sum. The noise stream's covariance across releases is sigma^2 C^{-1} C^{-T}.

**BLT** (buffered linear Toeplitz; Dvijotham et al. 2024, McKenna 2024): C is lower-triangular Toeplitz with

    c_0 = 1,   c_t = sum_i omega_i * theta_i^(t-1)   (t >= 1),

``theta`` the buffers' decays and ``omega`` their output scales. Its noise stream keeps one buffer of the
model's size per theta (:func:`blt_noise_step`)::

    x_t = z_t - sum_i omega_i * buf_i          (= (C^{-1} z)_t)
    buf_i <- theta_i * buf_i + x_t

**Sensitivity.** A contributor takes part in at most k releases, any two at least b apart (min separation).
Its clipped update (norm <= clip) then moves C x by at most clip * sens, with ``sens`` the largest norm of a
sum of k columns of C at least b apart; for a Toeplitz C with non-negative, non-increasing coefficients the
largest is the earliest, columns 0, b, 2b, ... (:func:`toeplitz_min_sep_sensitivity`). The whole stream is
one Gaussian mechanism with noise multiplier z = sigma / (clip * sens): its epsilon is one Gaussian event's,
composed once, whatever n.

Worked example (jax_privacy 2.0's numbers for the same strategy, ``tests/test_correlated.py``):

>>> blt = Blt(theta=(0.9, 0.5), omega=(0.2, 0.1))
>>> blt.coefs(4).round(4).tolist()
[1.0, 0.3, 0.23, 0.187]
>>> blt.inverse_coefs(4).round(4).tolist()
[1.0, -0.3, -0.14, -0.076]
>>> round(toeplitz_min_sep_sensitivity(blt.coefs(8), min_sep=2, max_participations=4), 6)
2.823537
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Sequence

import numpy as np


def participations(n: int, min_sep: int, max_participations: int) -> int:
    """The most releases of n one contributor can take part in, at least ``min_sep`` apart and at most
    ``max_participations``: min(k, ceil(n / b))."""
    return min(max_participations, -(-n // min_sep))


@dataclasses.dataclass(frozen=True)
class Blt:
    """A BLT strategy: C's Toeplitz coefficients are 1, then sum_i omega_i theta_i^(t-1) (see the module).

    ``theta`` in [0, 1) keeps C's coefficients bounded; the noise stream holds ``len(theta)`` buffers.
    """

    theta: tuple[float, ...]
    omega: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "theta", tuple(float(t) for t in self.theta))
        object.__setattr__(self, "omega", tuple(float(w) for w in self.omega))
        if len(self.theta) != len(self.omega) or not self.theta:
            raise ValueError(f"a BLT has as many output scales as buffer decays (at least one), got"
                             f" {len(self.theta)} and {len(self.omega)}")
        if not all(0.0 <= t < 1.0 for t in self.theta):
            raise ValueError(f"BLT buffer decays must be in [0, 1), got {self.theta}")
        if not all(math.isfinite(w) for w in self.omega):
            raise ValueError(f"BLT output scales must be finite, got {self.omega}")

    @property
    def buffers(self) -> int:
        return len(self.theta)

    def coefs(self, n: int) -> np.ndarray:
        """c_0 .. c_{n-1}, float64."""
        t = np.arange(max(n - 1, 0), dtype=np.float64)
        tail = (np.asarray(self.omega)[:, None] * np.asarray(self.theta)[:, None] ** t).sum(axis=0)
        return np.concatenate([[1.0], tail])[:n]

    def inverse_coefs(self, n: int) -> np.ndarray:
        """C^{-1}'s Toeplitz coefficients d_0 .. d_{n-1} (d_0 = 1; d_t = -sum_{j=1..t} c_j d_{t-j})."""
        c = self.coefs(n)
        d = np.zeros(n)
        if n:
            d[0] = 1.0
        for t in range(1, n):
            d[t] = -np.dot(c[1 : t + 1], d[t - 1 :: -1][:t])
        return d

    def matrix(self, n: int) -> np.ndarray:
        """C, n x n (small n: tests and accounting)."""
        return toeplitz_matrix(self.coefs(n))


@dataclasses.dataclass(frozen=True)
class BandedToeplitz:
    """A banded Toeplitz strategy: C's first column is ``coefs`` (c_0 > 0, as many as bands), then zeros.
    Its noise stream keeps the last ``bands - 1`` noise rows (:func:`banded_noise_step`)::

        x_t = (z_t - sum_{j=1..bands-1} c_j x_{t-j}) / c_0
    """

    coefs_: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "coefs_", tuple(float(c) for c in self.coefs_))
        if not self.coefs_ or not self.coefs_[0] > 0 or not all(math.isfinite(c) for c in self.coefs_):
            raise ValueError(f"a banded strategy needs finite coefficients with c_0 > 0, got {self.coefs_}")

    @property
    def bands(self) -> int:
        return len(self.coefs_)

    @property
    def buffers(self) -> int:
        """Noise rows its stream keeps."""
        return self.bands - 1

    def coefs(self, n: int) -> np.ndarray:
        return np.concatenate([self.coefs_, np.zeros(max(0, n - self.bands))])[:n]

    def matrix(self, n: int) -> np.ndarray:
        return toeplitz_matrix(self.coefs(n))


def banded_noise_step(z: np.ndarray, history: np.ndarray, strategy: BandedToeplitz) -> np.ndarray:
    """The next row of C^{-1} Z for a banded Toeplitz strategy: ``history`` holds the last ``bands - 1`` rows,
    newest first, ``(bands - 1, *z.shape)`` float64 (zero before the first release), updated in place.

    >>> strategy = BandedToeplitz((2.0, 1.0))
    >>> history = np.zeros((1, 1))
    >>> [banded_noise_step(np.array([4.0]), history, strategy).tolist() for _ in range(3)]
    [[2.0], [1.0], [1.5]]
    """
    if history.shape != (strategy.buffers, *np.shape(z)):
        raise ValueError(f"banded history of shape {history.shape}, expected {(strategy.buffers, *np.shape(z))}")
    x = np.asarray(z, np.float64).copy()
    for coef, earlier in zip(strategy.coefs_[1:], history):
        x -= coef * earlier
    x /= strategy.coefs_[0]
    if strategy.buffers:
        history[1:] = history[:-1].copy()
        history[0] = x
    return x


def inverse_toeplitz_coefs(coefs: Sequence[float] | np.ndarray) -> np.ndarray:
    """The first column of C^{-1} for the lower-triangular Toeplitz C whose first column is ``coefs`` (c_0 != 0):
    d_0 = 1 / c_0, d_t = -(sum_{j=1..t} c_j d_{t-j}) / c_0 (C^{-1} is lower-triangular Toeplitz too).

    >>> inverse_toeplitz_coefs([2.0, 1.0, 0.0]).tolist()
    [0.5, -0.25, 0.125]
    """
    c = np.asarray(coefs, np.float64)
    d = np.zeros(len(c))
    for t in range(len(c)):
        d[t] = ((1.0 if t == 0 else 0.0) - np.dot(c[1 : t + 1], d[t - 1 :: -1][:t])) / c[0]
    return d


def toeplitz_matrix(coefs: Sequence[float] | np.ndarray) -> np.ndarray:
    """The lower-triangular Toeplitz matrix whose first column is ``coefs``."""
    c = np.asarray(coefs, np.float64)
    n = len(c)
    i, j = np.indices((n, n))
    return np.where(i >= j, c[np.clip(i - j, 0, None)], 0.0)


def blt_noise_step(z: np.ndarray, buffers: np.ndarray, blt: Blt) -> np.ndarray:
    """The next row of C^{-1} Z for a BLT: ``z`` is this release's iid draw (any shape), ``buffers`` the
    stream's state, ``(blt.buffers, *z.shape)`` float64, zero before the first release, updated in place.

    >>> blt = Blt(theta=(0.5,), omega=(1.0,))
    >>> buffers = np.zeros((1, 2))
    >>> [blt_noise_step(np.array([1.0, 2.0]), buffers, blt).tolist() for _ in range(3)]
    [[1.0, 2.0], [0.0, 0.0], [0.5, 1.0]]
    """
    if buffers.shape != (blt.buffers, *np.shape(z)):
        raise ValueError(f"BLT buffers of shape {buffers.shape}, expected {(blt.buffers, *np.shape(z))}")
    x = np.asarray(z, np.float64).copy()
    for scale, buffer in zip(blt.omega, buffers):
        x -= scale * buffer
    for decay, buffer in zip(blt.theta, buffers):
        buffer *= decay
        buffer += x
    return x


def strategy_step(x: np.ndarray, state: np.ndarray, strategy: Blt | BandedToeplitz) -> np.ndarray:
    """The next entry of ``C x`` for a stream ``x_0, x_1, ...`` (any shape each), one at a time: ``(C x)_t =
    sum_{s <= t} c_{t-s} x_s`` with the memory the noise stream keeps (``state``: ``(strategy.buffers,
    *x.shape)`` float64, zero before the first entry, updated in place). A BLT's buffers hold ``sum_{s < t}
    theta_i^(t-1-s) x_s`` (then ``(C x)_t = x_t + sum_i omega_i buf_i``); a banded strategy's the last
    ``bands - 1`` entries, newest first. An audit decorrelates a stream's projections with it.

    >>> blt = Blt(theta=(0.5,), omega=(1.0,))  # c = 1, 1, 0.5, ...
    >>> state = np.zeros((1, 1))
    >>> [strategy_step(np.array([v]), state, blt).tolist() for v in (1.0, 0.0, 0.0)]
    [[1.0], [1.0], [0.5]]
    >>> history = np.zeros((1, 1))
    >>> [strategy_step(np.array([v]), history, BandedToeplitz((2.0, 1.0))).tolist() for v in (1.0, 3.0)]
    [[2.0], [7.0]]
    """
    if state.shape != (strategy.buffers, *np.shape(x)):
        raise ValueError(f"strategy state of shape {state.shape}, expected {(strategy.buffers, *np.shape(x))}")
    x = np.asarray(x, np.float64)
    if isinstance(strategy, Blt):
        out = x.copy()
        for scale, buffer in zip(strategy.omega, state):
            out += scale * buffer
        for decay, buffer in zip(strategy.theta, state):
            buffer *= decay
            buffer += x
        return out
    out = strategy.coefs_[0] * x
    for coef, earlier in zip(strategy.coefs_[1:], state):
        out += coef * earlier
    if strategy.buffers:
        state[1:] = state[:-1].copy()
        state[0] = x
    return out


def toeplitz_min_sep_sensitivity(coefs: Sequence[float] | np.ndarray, min_sep: int, max_participations: int) -> float:
    """The sensitivity of the lower-triangular Toeplitz strategy with these coefficients (n = their count)
    under participation in at most k releases at least b apart: the norm of the sum of columns 0, b, ...,
    (k'-1) b, k' = :func:`participations`. Exact for non-negative, non-increasing coefficients (refused
    otherwise: the earliest columns are then not always the worst)."""
    c = np.asarray(coefs, np.float64)
    n = len(c)
    if min_sep < 1 or max_participations < 1:
        raise ValueError(f"min_sep and max_participations must be >= 1, got {min_sep} and {max_participations}")
    if np.any(c < 0) or np.any(np.diff(c) > 0):
        raise ValueError("the min-separation sensitivity is exact for non-negative, non-increasing coefficients"
                         " only")
    column_sum = np.zeros(n)
    for j in range(participations(n, min_sep, max_participations)):
        column_sum[j * min_sep :] += c[: n - j * min_sep]
    return float(np.linalg.norm(column_sum))


def check_stream(releases: int, min_sep: int, max_participations: int, buffers: int | None = None) -> None:
    """Refuses (ValueError, with the reason) a stream no strategy serves."""
    if releases < 1:
        raise ValueError(f"releases must be >= 1, got {releases}")
    if not 1 <= min_sep <= releases:
        raise ValueError(f"min_separation must be in [1, releases={releases}], got {min_sep}")
    if max_participations < 1:
        raise ValueError(f"max_participations must be >= 1, got {max_participations}")
    if buffers is not None and not 1 <= buffers <= min(releases, 10):
        raise ValueError(f"buffers must be in [1, min(releases={releases}, 10)], got {buffers}")


@functools.lru_cache(maxsize=64)  # deterministic: ledgers with one plan share it
def optimize_blt(releases: int, min_sep: int, max_participations: int, buffers: int | None = None) -> Blt:
    """The BLT that jax_privacy's optimizer finds for ``releases`` releases under (b, k) participation,
    minimizing the largest error of a prefix sum times the squared sensitivity (its ``error='max'``); with
    ``buffers`` that many buffers, else as many as still help (1 to 10). Slow: 10 to 60 s of compilation
    and optimization on a CPU; run it once per stream."""
    check_stream(releases, min_sep, max_participations, buffers)
    import jax
    from jax_privacy.matrix_factorization import buffered_toeplitz

    low, high = (buffers, buffers) if buffers is not None else (1, min(releases, 10))
    with jax.enable_x64():
        found = buffered_toeplitz.optimize(n=releases, min_sep=min_sep, max_participations=max_participations,
                                           error="max", min_buffers=low, max_buffers=high)
        return Blt(tuple(np.asarray(found.buf_decay, np.float64)), tuple(np.asarray(found.output_scale, np.float64)))


def prefix_noise_multiplier(z: float, strategy: Blt | BandedToeplitz, releases: int, made: int, min_sep: int,
                            max_participations: int) -> float:
    """The noise multiplier of the first ``made`` releases of a stream planned for ``releases``, whose noise
    stddev is ``z * clip * sens(releases)``: they are one Gaussian mechanism on C_made x with sensitivity
    ``clip * sens(made)``, so ``z * sens(releases) / sens(made)`` (>= z; equal once the stream is spent).
    Its epsilon is one Gaussian event's (not composed per release)."""
    if not 1 <= made <= releases:
        raise ValueError(f"made must be in [1, {releases}], got {made}")
    full = toeplitz_min_sep_sensitivity(strategy.coefs(releases), min_sep, max_participations)
    prefix = toeplitz_min_sep_sensitivity(strategy.coefs(made), min_sep, max_participations)
    return z * full / prefix


@functools.lru_cache(maxsize=64)
def optimize_banded(releases: int, bands: int, min_sep: int, max_participations: int) -> BandedToeplitz:
    """The banded Toeplitz strategy of ``bands`` bands that jax_privacy's optimizer finds for ``releases``
    releases (its ``optimize_banded_toeplitz``: mean error of the prefix sums, coefficients of norm 1).
    ``bands`` must not pass the min separation (its sensitivity is then that of ``k'`` disjoint columns)."""
    check_stream(releases, min_sep, max_participations)
    if not 1 <= bands <= min_sep:
        raise ValueError(f"bands must be in [1, min_separation={min_sep}], got {bands}")
    import jax
    from jax_privacy.matrix_factorization import toeplitz

    with jax.enable_x64():
        return BandedToeplitz(tuple(np.asarray(toeplitz.optimize_banded_toeplitz(releases, bands), np.float64)))


class Mechanism(str, enum.Enum):
    """How a ledger's releases are noised: independent Gaussians, or a correlated stream."""

    INDEPENDENT = "independent"
    BLT = "blt"
    BANDED = "banded"


@dataclasses.dataclass(frozen=True)
class CorrelatedNoise:
    """A ledger's correlated noise stream (DP-FTRL), fixed with its first private aggregation.

    Attributes:
      mechanism: ``blt`` or ``banded``.
      releases: n, the releases the stream is planned (and accounted) for; the (n+1)-th is refused.
      min_separation: b, the fewest releases between two in which one contributor takes part (1: any).
      max_participations: k, the most releases one contributor takes part in.
      buffers: a BLT's buffers (0: as many as still help, up to 10), or a banded strategy's bands (0: b, at
        most 8).
      declared: the participation is declared by the caller (DP-SGD's fixed epochs) and trusted, not
        enforced per client id by the server.
      strategy: the optimized strategy, filled in by the server from the ledger: a BLT's decays then its
        output scales, or a banded strategy's coefficients.
    """

    mechanism: Mechanism
    releases: int
    min_separation: int = 1
    max_participations: int = 1
    buffers: int = 0
    declared: bool = False
    strategy: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "mechanism", Mechanism(self.mechanism))
        object.__setattr__(self, "strategy", tuple(float(v) for v in self.strategy))
        if self.mechanism is Mechanism.INDEPENDENT:
            raise ValueError("correlated noise is 'blt' or 'banded' (independent noise needs no stream)")
        check_stream(self.releases, self.min_separation, self.max_participations,
                     self.buffers if self.mechanism is Mechanism.BLT and self.buffers else None)
        if self.mechanism is Mechanism.BANDED and not 0 <= self.buffers <= self.min_separation:
            raise ValueError(f"a banded strategy has at most min_separation={self.min_separation} bands (then its"
                             f" sensitivity is k' columns'), got {self.buffers}")
        if self.strategy:
            self.strategy_matrix()  # checks it

    @property
    def bands(self) -> int:
        """A banded strategy's bands (its ``buffers``, or b up to 8)."""
        return self.buffers or min(self.min_separation, 8)

    def optimized(self) -> CorrelatedNoise:
        """This stream with its strategy: jax_privacy's optimum for (n, b, k) (10 to 60 s; once per ledger)."""
        if self.mechanism is Mechanism.BLT:
            blt = optimize_blt(self.releases, self.min_separation, self.max_participations, self.buffers or None)
            return dataclasses.replace(self, strategy=blt.theta + blt.omega)
        banded = optimize_banded(self.releases, self.bands, self.min_separation, self.max_participations)
        return dataclasses.replace(self, strategy=banded.coefs_)

    def strategy_matrix(self) -> Blt | BandedToeplitz:
        """The strategy as an object (ValueError if it is not filled in)."""
        if not self.strategy:
            raise ValueError("the stream's strategy is not known yet (the server fills it in from its ledger)")
        if self.mechanism is Mechanism.BLT:
            half = len(self.strategy) // 2
            return Blt(self.strategy[:half], self.strategy[half:])
        return BandedToeplitz(self.strategy)

    def sensitivity(self, made: int | None = None) -> float:
        """The strategy's sensitivity under (b, k) over its first ``made`` releases (default all n)."""
        return toeplitz_min_sep_sensitivity(self.strategy_matrix().coefs(made or self.releases),
                                            self.min_separation, self.max_participations)

    def prefix_noise_multiplier(self, z: float, made: int) -> float:
        """The noise multiplier of its first ``made`` releases (:func:`prefix_noise_multiplier`)."""
        return prefix_noise_multiplier(z, self.strategy_matrix(), self.releases, made, self.min_separation,
                                       self.max_participations)

    def release_noise_scale(self, release: int) -> float:
        """``||row release of C^{-1}||`` (0-based): release t's noise is that times the stream's sigma per
        coordinate (its rows of ``C^{-1} Z``, Z i.i.d. of stddev sigma)."""
        if not 0 <= release < self.releases:
            raise ValueError(f"release must be in [0, {self.releases}), got {release}")
        inverse = inverse_toeplitz_coefs(self.strategy_matrix().coefs(release + 1))
        return float(np.linalg.norm(inverse))

    @property
    def state_rows(self) -> int:
        """Rows of the model's size the stream keeps: a BLT's buffers, a banded strategy's bands - 1."""
        return self.strategy_matrix().buffers

    def step(self, z: np.ndarray, state: np.ndarray) -> np.ndarray:
        """The next noise row (unit stddev) from the iid draw ``z``; ``state`` updated in place."""
        strategy = self.strategy_matrix()
        if isinstance(strategy, Blt):
            return blt_noise_step(z, state, strategy)
        return banded_noise_step(z, state, strategy)
