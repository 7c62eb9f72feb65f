"""Draws of OpenDP's discrete Gaussian ``N_Z(0, scale^2)`` as int64, here or in a worker process.

A worker is ``python -m clipd._discrete_gaussian SIZE SCALE CHUNK``: it writes SIZE int64 draws to its
stdout, CHUNK at a time. This module imports numpy and OpenDP only (``clipd/__init__`` imports nothing), so
a worker starts in a fraction of a second, without JAX and without the caller's threads or ``__main__``.
``clipd.engine._secure_noise`` splits a large release's draws between such workers.
"""

from __future__ import annotations

import functools
import sys

import numpy as np


@functools.lru_cache(maxsize=64)
def measurement(scale: float):
    """OpenDP's discrete Gaussian on int64 vectors under the L2 distance, of ``scale`` (its stddev parameter)."""
    # OpenDP's own modules, not opendp.prelude: the prelude imports its extras too (scikit-learn among them, ~1.2 s
    # of a worker's start). The same functions (prelude's dp.m is opendp.measurements).
    from opendp.domains import atom_domain, vector_domain
    from opendp.measurements import make_gaussian
    from opendp.metrics import l2_distance
    from opendp.mod import enable_features

    enable_features("contrib")
    return make_gaussian(vector_domain(atom_domain(T="i64")), l2_distance(T="i64"), scale=float(scale))


def draw(size: int, scale: float) -> np.ndarray:
    """``size`` draws of ``N_Z(0, scale^2)`` in this process (OpenDP noises a zero vector).

    >>> draw(4, 0.5).dtype
    dtype('int64')
    """
    return np.asarray(measurement(scale)(np.zeros(size, np.int64)), np.int64)


def main(argv: list[str]) -> None:
    """The worker: ``SIZE SCALE CHUNK`` -> SIZE int64 draws on stdout."""
    size, scale, chunk = int(argv[0]), float(argv[1]), int(argv[2])
    for start in range(0, size, chunk):
        sys.stdout.buffer.write(draw(min(chunk, size - start), scale).tobytes())


if __name__ == "__main__":
    main(sys.argv[1:])
