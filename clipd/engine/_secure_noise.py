"""Secure noise: a release on an integer grid with discrete Gaussian noise, and its accounting.

The default release adds JAX's float32 normal to a float sum. Floating point
leaves two holes there (docs/privacy.md, "What it does not protect against"): the
set of floats a continuous sampler can output reveals the value it was added
to (Mironov 2012; Jin et al. 2021), and a float sum can move by more than its
nominal sensitivity when one contribution changes, depending on the order of
the additions (Casacuberta et al. 2022). The secure release closes both:

    r_i      = rint(m_i x_i / g)                 each clipped example on the grid of step g
    R        = sum_i r_i                          exact integers (the accumulator's fixed point)
    release  = g * (R + Z),   Z ~ N_Z(0, s^2)^d   (Canonne, Kamath and Steinke 2020)

with ``Z`` drawn by OpenDP's exact sampler (integer and rational arithmetic,
bits from a CSPRNG), so every released value is a whole number of steps.

**Sensitivity on the grid.** The accumulator clips each example to norm at most
``C`` whatever order its float norm was summed in, so its float32 product
``v_i`` has ``||v_i|| <= C (1 + u)``, and ``||r_i - v_i / g|| <= sqrt(d) / 2``
(each coordinate rounds by at most 1/2). ``R`` is exact, so adding or removing
one example moves it by exactly ``r_i``, in any order:
``||r_i|| <= C (1 + u) / g + sqrt(d) / 2``; replacing one moves it by twice that.
:func:`grid_sensitivity` is that bound, rounded up.

**The grid.** ``g`` is the largest power of two with ``sqrt(d) g <= C 2^-GRID_BITS``
(the rounding widens the sensitivity by at most ``2^-(GRID_BITS + 1)``), but not
below ``C 2^-19``: the accumulator's integers must stay under 2^20. Past
``d = 2^18`` the floor decides, and the widening is ``sqrt(d) 2^-20`` (0.1% at
``d = 10^6``, 0.95% at ``d = 10^8``). Dividing by a power of two is exact.

**Privacy.** The discrete Gaussian with an integer shift ``mu`` satisfies
``||mu||^2 / (2 s^2)``-zCDP (Canonne, Kamath and Steinke, Theorem 14 for the
multivariate case; the continuous Gaussian's bound); with ``s = z * Dg``, a
release is ``1 / (2 z^2)``-zCDP, as the continuous Gaussian of multiplier ``z``.
Releases compose by adding their ``rho``; epsilon at ``delta`` is OpenDP's
conversion of the total. This holds for releases on the whole data set:
amplification by sampling is not claimed (no vetted accountant bounds the
subsampled discrete Gaussian).

Example: a bound of 1 over a million coordinates:

  >>> step = grid_step(1.0, 1_000_000)
  >>> step == 2.0 ** -19, grid_sensitivity(1.0, step, 1_000_000)
  (True, 524789)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import numpy as np

from .._discrete_gaussian import draw, measurement
from ._accumulator import FIXED_POINT_RANGE

GRID_BITS = 10
"""Where it can, the grid is fine enough that rounding widens the sensitivity by at most 2^-(GRID_BITS + 1)."""
FINEST = FIXED_POINT_RANGE.bit_length() - 2
"""The grid is never finer than ``C 2^-FINEST`` (2^-19): the accumulator's integers stay under FIXED_POINT_RANGE."""
UNIT = 2.0 ** -24  # float32's unit roundoff

CHUNK = 1 << 18
"""Draws per sampler call (bounds the memory of OpenDP's list); from ``PARALLEL_FROM`` draws on, processes share
them."""
PARALLEL_FROM = 1 << 18

MAX_GRID_VALUE = 1 << 52
"""``|R|`` must stay below this: then ``g * (R + Z)`` is exact in float64 (the noise is far smaller)."""


def grid_step(bound: float, dimension: int, bits: int = GRID_BITS) -> float:
    """The largest power of two ``g`` with ``sqrt(dimension) g <= bound 2^-bits``, but at least ``bound 2^-FINEST``.

    >>> grid_step(1.0, 1), grid_step(4.0, 16), grid_step(1.0, 10 ** 8) == 2.0 ** -19
    (0.0009765625, 0.0009765625, True)
    """
    if not (bound > 0 and math.isfinite(bound)) or dimension < 1:
        raise ValueError(f"a grid needs a finite bound > 0 and a dimension >= 1, got {bound}, {dimension}")
    step = 2.0 ** math.floor(math.log2(bound * 2.0 ** -bits / math.sqrt(dimension)))
    while math.sqrt(dimension) * step > bound * 2.0 ** -bits:  # log2's rounding, at a power of two
        step /= 2
    finest = 2.0 ** math.ceil(math.log2(bound * 2.0 ** -FINEST))
    while finest < bound * 2.0 ** -FINEST:
        finest *= 2
    return max(step, finest)


def grid_sensitivity(bound: float, step: float, dimension: int, contributions: int = 1) -> int:
    """``ceil(k (C (1 + 2u) / g + sqrt(d) / 2))``: how far ``k`` examples (1: add or remove one; 2: replace one)
    move the sum on the grid, in L2, rounded up to an integer.

    >>> grid_sensitivity(1.0, 2.0 ** -4, 9), grid_sensitivity(1.0, 2.0 ** -4, 9, contributions=2)  # 16 + 1.5
    (18, 36)
    """
    half_root = (math.isqrt(dimension - 1) + 1) / 2  # ceil(sqrt(d)) / 2 >= sqrt(d) / 2, exactly
    return math.ceil(contributions * (bound / step * (1 + 2 * UNIT) + half_root))


def on_grid(values: np.ndarray, step: float) -> np.ndarray:
    """``values / step`` as int64, where every value is a whole number of steps (``ValueError`` otherwise).

    >>> on_grid(np.array([0.5, -1.25, 3.0]), 0.25)
    array([ 2, -5, 12])
    """
    scaled = np.asarray(values, np.float64) / step  # exact: step is a power of two
    if not np.all(np.abs(scaled) < MAX_GRID_VALUE):
        raise OverflowError(f"a sum of {np.max(np.abs(values)):.6g} does not fit a grid of step {step:g}")
    if not np.array_equal(np.rint(scaled), scaled):
        raise ValueError(f"a sum is not on the grid of step {step:g}: it was not summed in fixed point")
    return scaled.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class GridRelease:
    """A secure release: ``values = g * (round(S / g) + Z)`` per layer (float64, exact), and what was drawn."""

    values: tuple[np.ndarray, ...]
    step: float  # g
    scale: float  # s = z * Dg: of the discrete Gaussian, in grid steps

    @property
    def noise_stddev(self) -> float:
        """The noise's scale in the sum's units (``s * g``; the discrete Gaussian's stddev is just under it)."""
        return self.scale * self.step


def plan(bound: float, contributions: int, noise_multiplier: float, dimension: int) -> tuple[float, int, float]:
    """``(g, Dg, s)`` of a release of ``dimension`` coordinates of examples clipped to ``bound``, with multiplier
    ``z``; ``contributions`` is 1 under add/remove-one, 2 under replace-one."""
    step = grid_step(bound, dimension)
    widened = grid_sensitivity(bound, step, dimension, contributions)
    return step, widened, noise_multiplier * widened


def release(sums: Sequence[np.ndarray], step: float, scale: float, processes: int | None = None) -> GridRelease:
    """The secure release of fixed-point ``sums`` (one float64 array per layer, every value on the grid of
    ``step``): ``step * (sums / step + Z)``, ``Z`` of ``scale`` grid steps.

    >>> out = release([np.array([1.0, 2.0]), np.array([[3.0]])], 0.5, 0.0)
    >>> out.values, out.step
    ((array([1., 2.]), array([[3.]])), 0.5)
    """
    dimension = sum(int(np.size(s)) for s in sums)
    flat = on_grid(np.concatenate([np.ravel(s) for s in sums]), step) + discrete_gaussian(dimension, scale, processes)
    values = flat.astype(np.float64) * step  # exact: |flat| < 2^53 and step a power of two
    out, at = [], 0
    for total in sums:
        out.append(values[at:at + np.size(total)].reshape(np.shape(total)))
        at += np.size(total)
    return GridRelease(tuple(out), step, scale)


# The sampler -------------------------------------------------------------------------------
def discrete_gaussian(size: int, scale: float, processes: int | None = None) -> np.ndarray:
    """``size`` independent draws of the discrete Gaussian ``N_Z(0, scale^2)``, as int64.

    OpenDP draws about 10 us each on one core here (any scale); from
    ``PARALLEL_FROM`` draws on, the draws are split between ``processes``
    worker processes (default: every core). A worker is a fresh interpreter,
    ``python -m clipd._discrete_gaussian``, that imports numpy and OpenDP only
    and writes its int64 draws to a file: not a fork of a server with threads,
    and not a ``multiprocessing`` child that re-imports the caller's ``__main__``.

    >>> draws = discrete_gaussian(1000, 3.0)
    >>> draws.dtype, draws.shape, bool(2.0 < draws.std() < 4.0)
    (dtype('int64'), (1000,), True)
    """
    if size < 0 or not (scale >= 0 and math.isfinite(scale)):
        raise ValueError(f"discrete_gaussian: size >= 0 and a finite scale >= 0, got {size}, {scale}")
    if size == 0 or scale == 0:
        return np.zeros(size, np.int64)
    workers = min(processes or os.cpu_count() or 1, -(-size // CHUNK))
    if size < PARALLEL_FROM or workers < 2:
        return np.concatenate([draw(min(CHUNK, size - start), scale) for start in range(0, size, CHUNK)])
    shares = [size // workers + (k < size % workers) for k in range(workers)]
    outputs = [tempfile.TemporaryFile() for _ in shares]  # files, not pipes: no worker waits for a reader
    try:
        running = [subprocess.Popen([sys.executable, "-m", "clipd._discrete_gaussian", str(share), repr(float(scale)),
                                     str(CHUNK)],
                                    stdout=out, stderr=subprocess.PIPE) for share, out in zip(shares, outputs)]
        parts = []
        for share, worker, out in zip(shares, running, outputs):
            err = worker.communicate()[1]
            out.seek(0)
            data = out.read()
            if worker.returncode != 0 or len(data) != 8 * share:
                for other in running:
                    other.kill()
                raise RuntimeError(f"a discrete Gaussian worker failed (exit {worker.returncode}):"
                                   f" {err.decode()[-400:]}")
            parts.append(np.frombuffer(data, np.int64))
    finally:
        for out in outputs:
            out.close()
    return np.concatenate(parts)


# Accounting --------------------------------------------------------------------------------
def release_event_json(grid_sensitivity: int, scale: float, step: float, dimension: int) -> str:
    """A secure release as its ledger entry: the mechanism that was drawn, with what its accounting needs.

    >>> release_event_json(20, 40.0, 0.0625, 10)
    '{"discrete_gaussian": {"dimension": 10, "grid_sensitivity": 20, "grid_step": 0.0625, "scale": 40.0}}'
    """
    return json.dumps({"discrete_gaussian": {"grid_sensitivity": int(grid_sensitivity), "scale": float(scale),
                                             "grid_step": float(step), "dimension": int(dimension)}},
                      sort_keys=True)


def is_secure_event(text: str) -> bool:
    return text.startswith('{"discrete_gaussian"')


@functools.lru_cache(maxsize=256)
def release_rho(event_json: str) -> float:
    """The zCDP ``rho`` of one secure release, as OpenDP maps it (``grid_sensitivity^2 / (2 scale^2)``).

    >>> round(release_rho(release_event_json(20, 40.0, 0.0625, 10)), 12)
    0.125
    """
    event = json.loads(event_json)["discrete_gaussian"]
    return float(measurement(event["scale"]).map(event["grid_sensitivity"]))


def epsilon_of_rho(rho: float, delta: float) -> float:
    """Epsilon at ``delta`` of ``rho``-zCDP, by OpenDP's conversion (``make_zCDP_to_approxDP``).

    The conversion is of ``rho`` alone, so it is taken on one discrete
    Gaussian of that ``rho`` (scale ``1 / sqrt(2 rho)``, sensitivity 1). It is
    tighter than the textbook ``rho + 2 sqrt(rho log(1 / delta))`` (5.298 here):

    >>> round(epsilon_of_rho(0.5, 1e-5), 4)
    4.7284
    """
    from opendp.combinators import make_zCDP_to_approxDP  # (not opendp.prelude: see _discrete_gaussian.measurement)
    from opendp.domains import atom_domain
    from opendp.measurements import make_gaussian
    from opendp.metrics import absolute_distance
    from opendp.mod import enable_features

    if rho == 0:
        return 0.0
    if not math.isfinite(rho):
        return math.inf
    enable_features("contrib")
    one = make_gaussian(atom_domain(T="i64"), absolute_distance(T="i64"), scale=(2 * rho) ** -0.5)
    return float(make_zCDP_to_approxDP(one).map(1).epsilon(delta))


def epsilon(events: Sequence[str], delta: float) -> float:
    """Epsilon at ``delta`` of secure releases composed (their ``rho`` add up)."""
    return epsilon_of_rho(sum(release_rho(e) for e in events), delta)


def noise_multiplier_for(target_epsilon: float, delta: float, releases: int) -> float:
    """The smallest ``z`` (to 1e-9 relative) whose ``releases`` secure releases spend ``target_epsilon`` at ``delta``.

    Each release is ``1 / (2 z^2)``-zCDP; bisection on the total ``rho``.
    """
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)) or releases < 1:
        raise ValueError(f"calibration needs a finite target_epsilon > 0 and releases >= 1, got"
                         f" {target_epsilon}, {releases}")
    low, high = 0.0, 1.0
    while epsilon_of_rho(high, delta) < target_epsilon:
        low, high = high, high * 2
    while high - low > 1e-12 * high:
        middle = (low + high) / 2
        low, high = (middle, high) if epsilon_of_rho(middle, delta) <= target_epsilon else (low, middle)
    return math.sqrt(releases / (2 * low))
