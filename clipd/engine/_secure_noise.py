"""Secure noise: a release on an integer grid with discrete Gaussian noise, and its accounting.

The default release adds JAX's float32 normal to the float sum ``S``. Floating
point leaves two holes there (the README's "What it does not protect
against"): the set of floats a continuous sampler can output reveals the
value it was added to (Mironov 2012; Jin et al. 2021), and a float sum can
move by more than its nominal sensitivity when one contribution changes
(Casacuberta et al. 2022). The secure release closes the first hole by never
drawing a float:

    r        = round(S / g)                  the sum on the grid of step g (an integer vector)
    release  = g * (r + Z),   Z ~ N_Z(0, s^2)^d   (Canonne, Kamath and Steinke 2020)

with ``Z`` drawn by OpenDP's exact sampler (integer and rational arithmetic,
bits from a CSPRNG), so every released value lies on the grid.

**Sensitivity on the grid.** If one contribution moves the float sum by at most
``D`` in L2, it moves ``r`` by at most ``ceil(D / g) + ceil(sqrt(d))``: in each
coordinate ``|round(a) - round(b)| <= |a - b| + |e_a - e_b|`` with rounding
errors ``|e| <= 1/2``, so over ``d`` coordinates the rounding adds at most
``sqrt(d)`` (triangle inequality). :func:`grid_step` picks the largest power of
two with ``sqrt(d) * g <= D / 2^GRID_BITS``: the rounding widens the
sensitivity by at most ``2^-GRID_BITS`` (0.1%), and dividing a float by a power
of two is exact.

**Privacy.** The discrete Gaussian with an integer shift ``mu`` satisfies
``mu^2 / (2 s^2)``-zCDP (Canonne, Kamath and Steinke, Theorem 14 for the
multivariate case; it is the continuous Gaussian's bound); with ``s = z * Dg``,
``Dg`` the grid sensitivity above, a release is ``1 / (2 z^2)``-zCDP.
Releases compose by adding their ``rho``; epsilon at ``delta`` is OpenDP's
conversion of the total. This holds for releases on the whole data set;
amplification by sampling is not claimed (no vetted accountant bounds the
subsampled discrete Gaussian).

What this module does not settle: ``D`` itself. The float sum's own rounding
(Casacuberta et al.) must be inside ``D``; the server's sums are float32, and
the fixed-point accumulation that would make them exact is not built yet
(see docs/PRIVACY.md).

Example: a sensitivity of 1 over a million coordinates:

  >>> step = grid_step(1.0, 1_000_000)
  >>> step == 2.0 ** -20, grid_sensitivity(1.0, step, 1_000_000)
  (True, 1049576)
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

GRID_BITS = 10
"""The grid is fine enough that rounding onto it widens the sensitivity by at most 2^-GRID_BITS."""

CHUNK = 1 << 18
"""Draws per sampler call (bounds the memory of OpenDP's list); from ``PARALLEL_FROM`` draws on, processes share them."""
PARALLEL_FROM = 1 << 18

MAX_GRID_VALUE = 1 << 52
"""``|S / g|`` must stay below this: then ``g * (r + Z)`` is exact in float64 (the noise is far smaller)."""


def grid_step(sensitivity: float, dimension: int, bits: int = GRID_BITS) -> float:
    """The largest power of two ``g`` with ``sqrt(dimension) * g <= sensitivity * 2^-bits``.

    >>> grid_step(1.0, 1), grid_step(4.0, 16)
    (0.0009765625, 0.0009765625)
    """
    if not (sensitivity > 0 and math.isfinite(sensitivity)) or dimension < 1:
        raise ValueError(f"a grid needs a finite sensitivity > 0 and a dimension >= 1, got {sensitivity}, {dimension}")
    step = 2.0 ** math.floor(math.log2(sensitivity * 2.0 ** -bits / math.sqrt(dimension)))
    while math.sqrt(dimension) * step > sensitivity * 2.0 ** -bits:  # log2's rounding, at a power of two
        step /= 2
    return step


def grid_sensitivity(sensitivity: float, step: float, dimension: int) -> int:
    """``ceil(D / g) + ceil(sqrt(d))``: how far one contribution moves the sum on the grid (L2, integer).

    >>> grid_sensitivity(1.0, 2.0 ** -4, 10)  # 16 + ceil(3.16...)
    20
    """
    return math.ceil(sensitivity / step) + math.isqrt(dimension - 1) + 1


def to_grid(values: np.ndarray, step: float) -> np.ndarray:
    """``round(values / step)`` as int64 (half to even): the sum on the grid.

    >>> to_grid(np.array([0.3, -1.26, 2.5], np.float32), 0.5)
    array([ 1, -3,  5])
    """
    scaled = np.asarray(values, np.float64) / step  # exact: step is a power of two
    if not np.all(np.abs(scaled) < MAX_GRID_VALUE):
        raise OverflowError(f"a sum of {np.max(np.abs(values)):.6g} does not fit a grid of step {step:g};"
                            " lower the bound or the number of contributions")
    return np.rint(scaled).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class GridRelease:
    """A secure release: ``values = g * (round(S / g) + Z)`` per layer (float64, exact), and what was drawn."""

    values: tuple[np.ndarray, ...]
    step: float  # g
    grid_sensitivity: int  # Dg: of the sum on the grid, in grid steps
    scale: float  # s = z * Dg: of the discrete Gaussian, in grid steps
    event_json: str  # its ledger entry

    @property
    def noise_stddev(self) -> float:
        """The noise's scale in the sum's units (``s * g``; the discrete Gaussian's stddev is just under it)."""
        return self.scale * self.step


def plan(sensitivity: float, noise_multiplier: float, dimension: int) -> tuple[float, int, float]:
    """``(g, Dg, s)`` of a release of ``dimension`` coordinates with sensitivity ``D`` and multiplier ``z``."""
    step = grid_step(sensitivity, dimension)
    widened = grid_sensitivity(sensitivity, step, dimension)
    return step, widened, noise_multiplier * widened


def release(sums: Sequence[np.ndarray], sensitivity: float, noise_multiplier: float,
            processes: int | None = None) -> GridRelease:
    """The secure release of ``sums`` (one array per layer) whose sensitivity is ``D``, with multiplier ``z``.

    >>> out = release([np.array([1.0, 2.0]), np.array([[3.0]])], 1.0, 0.0)
    >>> out.values, out.step, out.grid_sensitivity
    ((array([1., 2.]), array([[3.]])), 0.00048828125, 2050)
    """
    dimension = sum(int(np.size(s)) for s in sums)
    step, widened, scale = plan(sensitivity, noise_multiplier, dimension)
    flat = to_grid(np.concatenate([np.ravel(s) for s in sums]), step) + discrete_gaussian(dimension, scale, processes)
    values = flat.astype(np.float64) * step  # exact: |flat| < 2^53 and step a power of two
    out, at = [], 0
    for total in sums:
        out.append(values[at:at + np.size(total)].reshape(np.shape(total)))
        at += np.size(total)
    return GridRelease(tuple(out), step, widened, scale, release_event_json(widened, scale, step, dimension))


# The sampler -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _measurement(scale: float):
    """OpenDP's discrete Gaussian on int64 vectors under the L2 distance, of ``scale`` (its stddev parameter)."""
    import opendp.prelude as dp

    dp.enable_features("contrib")
    return dp.m.make_gaussian(dp.vector_domain(dp.atom_domain(T="i64")), dp.l2_distance(T="i64"), scale=float(scale))


def _draw(size: int, scale: float) -> np.ndarray:
    """``size`` draws of ``N_Z(0, scale^2)`` in this process (OpenDP noises a zero vector)."""
    return np.asarray(_measurement(scale)(np.zeros(size, np.int64)), np.int64)


_WORKER = """
import sys
import numpy as np
import opendp.prelude as dp
dp.enable_features("contrib")
size, scale, chunk = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
noise = dp.m.make_gaussian(dp.vector_domain(dp.atom_domain(T="i64")), dp.l2_distance(T="i64"), scale=scale)
for start in range(0, size, chunk):
    sys.stdout.buffer.write(np.asarray(noise(np.zeros(min(chunk, size - start), np.int64)), np.int64).tobytes())
"""


def discrete_gaussian(size: int, scale: float, processes: int | None = None) -> np.ndarray:
    """``size`` independent draws of the discrete Gaussian ``N_Z(0, scale^2)``, as int64.

    OpenDP draws about 10 us each on one core here (any scale); from
    ``PARALLEL_FROM`` draws on, the draws are split between ``processes``
    worker processes (default: every core). A worker is a fresh interpreter
    that imports numpy and OpenDP only and writes its int64 draws to a file:
    not a fork of a server with threads, and not a ``multiprocessing`` child
    that re-imports the caller's ``__main__``.

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
        return np.concatenate([_draw(min(CHUNK, size - start), scale) for start in range(0, size, CHUNK)])
    shares = [size // workers + (k < size % workers) for k in range(workers)]
    outputs = [tempfile.TemporaryFile() for _ in shares]  # files, not pipes: no worker waits for a reader
    try:
        running = [subprocess.Popen([sys.executable, "-c", _WORKER, str(share), repr(float(scale)), str(CHUNK)],
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


def release_rho(event_json: str) -> float:
    """The zCDP ``rho`` of one secure release, as OpenDP maps it (``grid_sensitivity^2 / (2 scale^2)``).

    >>> round(release_rho(release_event_json(20, 40.0, 0.0625, 10)), 12)
    0.125
    """
    event = json.loads(event_json)["discrete_gaussian"]
    return float(_measurement(event["scale"]).map(event["grid_sensitivity"]))


def epsilon_of_rho(rho: float, delta: float) -> float:
    """Epsilon at ``delta`` of ``rho``-zCDP, by OpenDP's conversion (``make_zCDP_to_approxDP``).

    The conversion is of ``rho`` alone, so it is taken on one discrete
    Gaussian of that ``rho`` (scale ``1 / sqrt(2 rho)``, sensitivity 1). It is
    tighter than the textbook ``rho + 2 sqrt(rho log(1 / delta))`` (5.298 here):

    >>> round(epsilon_of_rho(0.5, 1e-5), 4)
    4.7284
    """
    import opendp.prelude as dp

    if rho == 0:
        return 0.0
    if not math.isfinite(rho):
        return math.inf
    dp.enable_features("contrib")
    one = dp.m.make_gaussian(dp.atom_domain(T="i64"), dp.absolute_distance(T="i64"), scale=(2 * rho) ** -0.5)
    return float(dp.c.make_zCDP_to_approxDP(one).map(1).epsilon(delta))


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
