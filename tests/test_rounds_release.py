"""clipd.client.rounds: the arrays a federated round hands back to its framework, from a release's sums."""

from __future__ import annotations

import doctest
import tracemalloc

import numpy as np

from clipd.client import rounds


def test_the_module_doctests():
    assert doctest.testmod(rounds).failed == 0


def test_a_round_s_new_arrays_are_the_float64_mean_rounded_once_without_a_float64_copy_of_the_layer():
    """``current + sums / m`` and ``sums / m`` equal numpy's whole-array float64 formula bit for bit (a layer longer
    than one block, a shape, m = 3 and the server's own mean), and the temporaries stay a few blocks whatever the
    layer: a 2^23-element float32 layer (32 MiB) is made with at most its output and 4 blocks of float64 beside it,
    where the whole-array formula takes three float64 copies (192 MiB)."""
    rng = np.random.default_rng(7)
    current = rng.standard_normal((2_500_000,)).astype(np.float32)
    sums = rng.standard_normal((2_500_000,)).astype(np.float32)
    for m in (3.0, 1.0):
        for as_update in (True, False):
            mean = sums.astype(np.float64) / m
            expected = (mean if as_update else current + mean).astype(np.float32)
            got = rounds._new_array(current, sums, m, as_update)
            assert got.dtype == np.float32 and np.array_equal(got, expected)
    shaped = rng.standard_normal((3, 5)).astype(np.float16)
    assert np.array_equal(rounds._new_array(shaped, np.ones((3, 5)), 2.0, False),
                          (shaped + np.ones((3, 5)) / 2.0).astype(np.float16))

    layer, sums = np.zeros(1 << 23, np.float32), np.ones(1 << 23, np.float32)
    tracemalloc.start()
    try:
        rounds._new_array(layer, sums, 3.0, as_update=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= layer.nbytes + 4 * rounds.BLOCK * 8, peak
