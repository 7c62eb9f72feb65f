"""XLA:CPU layout tricks of the accumulator step, each behind a switch.

None of these changes a result (bit for bit): they change how many buffers a
step reads and writes and how many kernels it compiles to. The math in
``_accumulator`` calls them through the small functions below; each takes its
switch from :class:`Tricks`, so that ``benchmarks/engine.py`` times a step
with and without every one of them. A trick stays only while it buys >= 5% on
some row of that benchmark; the figures below are its ``without / with``
ratios (medians over interleaved repeats; 2 shared cores, no GPU, XLA:CPU,
jax 0.10.2). ``shared_sum_buffers`` changes nothing with one layer: its K = 1
rows, 0.95-1.08 on the same runs, show the noise.

Gone: chaining the per-layer dots one after the other (an optimization
barrier) read 0.97-1.03 where it was meant to help, (B, P, K) = (16 to 256,
1e6, 2 to 64), in three runs of 21-31 repeats; without it the step is as fast
as the original with all four tricks (0.97-1.02 from (1, 1e4, 1) to (256, 1e6, 8)).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Tricks(NamedTuple):
    """Which tricks a step uses (static: part of the compiled program's key). All on by default.

    >>> Tricks(packed_stats=False)
    Tricks(packed_stats=False, shared_sum_buffers=True, hoisted_fast_path=True)
    """

    packed_stats: bool = True
    shared_sum_buffers: bool = True
    hoisted_fast_path: bool = True


ALL = Tricks()


# Shared sum buffers --------------------------------------------------------------------

CHUNK_ELEMENTS = 1 << 16
"""Consecutive layers smaller than this share one sum buffer (one add per step instead of many)."""


def sum_buffer_runs(sizes: Sequence[int], shared: bool = True) -> tuple[tuple[int, int], ...]:
    """Runs ``(first, end)`` of consecutive layers that share a flat sum buffer.

    Trick ``shared_sum_buffers``: small layers are packed together up to
    ``CHUNK_ELEMENTS``; a larger layer has its own buffer (adding a packed dot
    output costs a copy, which only pays off for small layers). Without it,
    every layer has its own buffer, one add kernel and one output each.
    Measured: ``python benchmarks/engine.py --only tricks --batches 16 256
    --params 10000 --layer-counts 1 8 64 --repeats 31``, two runs: 1.09 and
    1.11 at (16, 1e4, 8), 1.37 and 1.39 at (16, 1e4, 64), 1.07 and 1.06 at
    (256, 1e4, 8), 1.23 and 1.19 at (256, 1e4, 64); 1.00-1.07 with P = 1e6
    and B >= 16.

    >>> sum_buffer_runs([10, 20, 70_000, 5, 5])
    ((0, 2), (2, 3), (3, 5))
    >>> sum_buffer_runs([10, 20, 70_000], shared=False)
    ((0, 1), (1, 2), (2, 3))
    """
    if not shared:
        return tuple((k, k + 1) for k in range(len(sizes)))
    runs, first, total = [], 0, 0
    for k, size in enumerate(sizes):
        if k > first and total + size > CHUNK_ELEMENTS:
            runs.append((first, k))
            first, total = k, 0
        total += size
    runs.append((first, len(sizes)))
    return tuple(runs)


def add_to_sum_buffers(buffers: Sequence[jax.Array], sums: Sequence[jax.Array], runs) -> tuple:
    """Each buffer plus the flat sums of its run of layers."""
    return tuple(
        buffer + (jnp.concatenate(sums[i:j]) if j - i > 1 else sums[i])
        for buffer, (i, j) in zip(buffers, runs)
    )


# Hoisted fast path ---------------------------------------------------------------------


def cond(pred: jax.Array, rare: Callable, usual: Callable, operands, hoisted: bool = True):
    """``lax.cond(pred, rare, usual, operands)``.

    Trick ``hoisted_fast_path``: ``usual`` is computed outside the cond, always,
    and the cond only swaps in ``rare``'s result when ``pred`` holds (probably
    because XLA:CPU runs a branch's kernels in turn and the top level's at
    once: faster for a few large dots, slower for many tiny ones). Measured:
    ``python benchmarks/engine.py --only tricks --batches 16 256 --params
    10000 --layer-counts 1 8 64 --repeats 31``, two runs: 1.21 and 1.21 at
    (256, 1e4, 8), but 0.91 and 0.90 at (16, 1e4, 64); 0.96-1.03 on the other
    rows, P = 1e6 included.
    """
    if hoisted:
        result = usual(operands)
        return jax.lax.cond(pred, rare, lambda _: result, operands)
    return jax.lax.cond(pred, rare, usual, operands)


# Packed statistics ---------------------------------------------------------------------

_INT_OF_FLOAT = {np.dtype(np.float32): np.int32, np.dtype(np.float64): np.int64}
_FLOAT_OF_INT = {np.dtype(i): f for f, i in _INT_OF_FLOAT.items()}


def count_dtype(float_dtype) -> np.dtype:
    """The integer dtype of the counts next to float statistics (int32, int64 for float64)."""
    return np.dtype(_INT_OF_FLOAT[np.dtype(float_dtype)])


def stats_zeros(slots: int, k: int, float_dtype, packed: bool = True):
    """Zero statistics: ``slots`` counts and K norm sums and maxima.

    Trick ``packed_stats``: all in one integer vector, ``[counts, bits of the
    norm sums, bits of the norm maxima]``, updated by one select: one
    statistics kernel and output instead of three. A one-layer step then
    compiles to 8 kernels instead of 10, and XLA:CPU runs a program of at most
    8 inline, not through its thread pool (ThunkExecutor's
    ``execute_sequential_num_thunks_threshold``). Without it, a tuple
    ``(counts, norm_sum, norm_max)``. Measured: ``python benchmarks/engine.py
    --only tricks --batches 1 16 --params 1000 10000 --layer-counts 1
    --repeats 61``, two runs: 1.20-1.27 with B = 1 (16-22 us steps), 1.15 and
    1.22 at (16, 1e3, 1), 1.10 and 1.07 at (16, 1e4, 1); ~1.0 with K >= 8.
    """
    counts = jnp.zeros((slots + 2 * k if packed else slots,), count_dtype(float_dtype))
    return counts if packed else (counts, jnp.zeros((k,), float_dtype), jnp.zeros((k,), float_dtype))


def unpack_stats(stats, k: int):
    """``(counts, norm_sum, norm_max)`` of packed or unpacked statistics, on jax or numpy arrays.

    >>> packed = np.array([5, 2, *np.float32([1.5, 4.0]).view(np.int32)], np.int32)
    >>> unpack_stats(packed, 1)
    (array([5, 2], dtype=int32), array([1.5], dtype=float32), array([4.], dtype=float32))
    """
    if isinstance(stats, tuple):
        return stats
    n = stats.shape[0] - 2 * k
    return stats[:n], _bits_to_float(stats[n : n + k]), _bits_to_float(stats[n + k :])


def add_stats(stats, counts: jax.Array, norm_sum: jax.Array, norm_max: jax.Array):
    """``stats`` plus counts and norm sums, maxed with norm maxima.

    Packed, one elementwise select over the whole vector, so that XLA updates it in place.
    """
    if isinstance(stats, tuple):
        old_counts, old_sum, old_max = stats
        return old_counts + counts.astype(old_counts.dtype), old_sum + norm_sum, jnp.maximum(old_max, norm_max)
    n, k = counts.shape[0], norm_sum.shape[0]
    floats = _bits_to_float(stats)
    zeros = jnp.zeros((k,), floats.dtype)
    summed = _float_to_bits(floats + jnp.concatenate([jnp.zeros((n,), floats.dtype), norm_sum, zeros]))
    maxed = _float_to_bits(jnp.maximum(floats, jnp.concatenate([jnp.zeros((n + k,), floats.dtype), norm_max])))
    counted = stats + jnp.concatenate([counts.astype(stats.dtype), jnp.zeros((2 * k,), stats.dtype)])
    slot = jnp.arange(stats.shape[0])
    return jnp.where(slot < n, counted, jnp.where(slot < n + k, summed, maxed))


def _bits_to_float(bits):
    dtype = _FLOAT_OF_INT[np.dtype(bits.dtype)]
    if isinstance(bits, np.ndarray):
        return np.ascontiguousarray(bits).view(dtype)
    return jax.lax.bitcast_convert_type(bits, dtype)


def _float_to_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, _INT_OF_FLOAT[np.dtype(x.dtype)])
