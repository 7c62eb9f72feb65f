"""The streaming clip-and-sum accumulator that the service runs on its device.

One jitted step per batch, as optax's ``per_example_global_norm_clip`` (or
``per_example_layer_norm_clip``) followed by a sum over the batch:

    norms       = the L2 norm of each example (or of each layer of it)
    multipliers = nan_to_num(min(bound / norms, 1), nan=1)
    sum_k      += multipliers @ layer_k           for every layer k
    clip counts, norm histograms, norm sums and maxima += those of the batch

With ``rescale_to_unit_norm`` a multiplier is jax_privacy's ``min(1, c/n) / c``
(or ``1/n`` when ``c = 0``, NaN and +inf becoming 0). An example is counted as
clipped when ``n > c``: a tie is not clipped, as in optax and jax_privacy.

Batches have a fixed padded size with a ``valid`` mask: padding rows
contribute exactly zero whatever they hold, so a few batch sizes are compiled
once and never again. The state is donated, so the sums are updated in place.
How the state is laid out in buffers, and where the dots are computed, is
``_xla_cpu``'s business (each of its tricks can be switched off).

**Fixed point** (``fixed_point_step = g > 0``, the secure release's sums): each
clipped example is rounded to the grid of step ``g`` on its own,
``r_i = rint(m_i x_i / g)``, and the integers are summed exactly (two int32
limbs, ``r = hi * 2^10 + lo``): the sum is the same in every order, and one
example moves it by exactly ``r_i``. Its norm is bounded without trusting a
float sum: the multiplier uses a bound ``C'`` below ``C`` by the worst-case
error of the float32 norm, summed in two stages of at most ``2 sqrt(n)`` terms
each (``conservative_bound``), so that ``||m_i x_i|| <= C`` whatever order XLA
adds in; then ``||r_i|| <= C (1 + 2^-24) / g + sqrt(d) / 2``. GLOBAL bounds
and whole-example zeroing of non-finite examples only.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _xla_cpu
from ._policy import ClipPolicy, LayerSpec, NonFinite
from ._xla_cpu import ALL, Tricks

RATIO_BUCKETS: tuple[float, ...] = (
    1 / 64, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 0.9, 1.0, 1.1, 1.5, 2.0, 4.0, 8.0, 16.0, 64.0,
)
"""Upper edges of the norm histogram, as ratios ``norm / bound``; a last bucket holds the rest.

Bucket ``i`` counts ``RATIO_BUCKETS[i-1] < norm / bound <= RATIO_BUCKETS[i]``, so the
bucket ending at 1.0 holds the examples that were not clipped (ties included).
"""
NUM_BUCKETS = len(RATIO_BUCKETS) + 1

LIMB_BITS = 10
"""A fixed-point integer ``r`` (``|r| < 2^20``) is kept as ``hi * 2^LIMB_BITS + lo``, ``0 <= lo < 2^LIMB_BITS``."""
FIXED_POINT_RANGE = 1 << 20
"""``|r| < FIXED_POINT_RANGE`` for every coordinate of every example: ``C / g <= 2^19`` (``_secure_noise.FINEST``)."""
FIXED_POINT_DELTA_ROWS = 1 << 20
"""Rows a fixed-point state may sum before its limbs could pass 2^30: flush it into host totals before."""
FLOAT32_UNIT = 2.0 ** -24  # the unit roundoff u of float32


def norm_blocks(size: int) -> int:
    """The block of the two-stage norm: a power of two near ``sqrt(size)``, so each stage adds ~sqrt(size) terms.

    >>> norm_blocks(1), norm_blocks(1000), norm_blocks(10 ** 6)
    (1, 32, 1024)
    """
    return 1 << max(0, math.ceil(math.log2(max(1, size)) / 2))


def conservative_bound(bound: float, sizes: Sequence[int]) -> np.float32:
    """``C'``: a float32 bound such that ``fl(min(1, C' / N^)) * ||x|| <= C`` for the computed norm ``N^``.

    ``N^2`` sums float32 squares in three stages (blocks of ``norm_blocks``, the
    blocks, the layers), each in any order: ``N^2 >= (1 - e) N^2`` with
    ``e = u + g(b) + g(n / b) + g(K)``, ``g(k) = k u / (1 - k u)`` (Higham,
    Accuracy and Stability, Lemma 3.1 and (3.4), for non-negative terms); the
    square root, the division and the product each round by at most ``u``.

    >>> 1.0 - 1e-4 < float(conservative_bound(1.0, [10 ** 6])) < 1.0 - 5e-5  # e is 1.2e-4 here
    True
    """
    u, largest = FLOAT32_UNIT, max(sizes)
    blocks = norm_blocks(largest)

    def gamma(k: int) -> float:
        return k * u / (1 - k * u)

    error = u + gamma(blocks) + gamma(math.ceil(largest / blocks)) + gamma(len(sizes))
    if error >= 0.01:
        raise ValueError(f"fixed point: a layer of {largest} elements is too large for a float32 norm bound")
    target = bound * (1 - u) * math.sqrt(1 - error) / (1 + u) * (1 - 1e-12)
    value = np.float32(target)
    return value if float(value) <= target else np.nextafter(value, np.float32(0))


def multiplier(norm: jax.Array, bound: jax.Array, rescale_to_unit_norm: bool) -> jax.Array:
    """The factor an example (or layer) of norm ``norm`` is scaled by.

    >>> multiplier(jnp.array([0.0, 1.0, 4.0]), jnp.float32(2.0), False)
    Array([1. , 1. , 0.5], dtype=float32)
    """
    if rescale_to_unit_norm:
        scale = jnp.minimum(1.0, bound / norm)
        scale = jnp.where(bound > 0, scale / bound, 1 / norm)
        return jnp.nan_to_num(scale, nan=0.0, posinf=0.0)
    return jnp.nan_to_num(jnp.minimum(bound / norm, 1.0), nan=1.0)


class _StepConfig(NamedTuple):
    """The static part of a step: what changes the compiled program (a tuple: cheap to hash)."""

    per_layer: bool
    rescale_to_unit_norm: bool
    non_finite: NonFinite
    tricks: Tricks = ALL
    fixed_point_step: float = 0.0  # g > 0: the sums are exact integers on the grid of step g


def _accumulate(state, layers, valid, limits, config, fresh=False, weights=None):
    """One step: ``state`` plus the clipped sum and statistics of the batch's valid rows.

    ``limits`` is ``[bounds (G), example bound]``: G = K bounds per layer, 1 global.
    ``fresh``: ``state``'s values are not read (taken as zero); its buffers only receive the step's.
    ``weights``: ``(B,)`` factors in [0, 1] applied to each row after its clip (a stale contribution's
    weight), or None (every row 1: the program without them).
    """
    if fresh:
        state = jax.tree.map(jnp.zeros_like, state)
    per_layer, mode = config.per_layer, config.non_finite
    groups = len(layers) if per_layer else 1
    dtype = jnp.dtype(jnp.float32) if config.fixed_point_step else state.sum_chunks[0].dtype
    rows = tuple(x.reshape(x.shape[0], -1) for x in layers)  # (B, n_k)
    squared = _squared_norms(rows, dtype)  # (K, B)
    finite = jnp.all(jnp.isfinite(squared), axis=0)  # (B,)

    def clip_and_sum(operands):
        rows, squared, valid, limits = operands
        multipliers = multiplier(_clip_norms(squared, per_layer), limits[:groups, None], config.rescale_to_unit_norm)
        multipliers = jnp.where(valid, _weighted(multipliers, weights), 0.0).astype(dtype)  # (G, B)
        # Full float32 precision on every backend (GPUs would otherwise round the inputs to TF32).
        return tuple(jnp.tensordot(multipliers[i if per_layer else 0], x.astype(dtype), axes=1,
                                   precision=jax.lax.Precision.HIGHEST) for i, x in enumerate(rows)), squared

    def clean_then_clip_and_sum(operands):  # zero what must not reach the sum first (one more pass)
        rows, squared, valid, limits = operands
        if mode is NonFinite.ZERO_ENTRIES:
            rows = tuple(jnp.where(valid[:, None] & jnp.isfinite(x), x, jnp.zeros((), x.dtype)) for x in rows)
        else:
            keep = valid & jnp.all(jnp.isfinite(squared), axis=0) if mode is NonFinite.ZERO_EXAMPLE else valid
            rows = tuple(jnp.where(keep[:, None], x, jnp.zeros((), x.dtype)) for x in rows)
        return clip_and_sum((rows, _squared_norms(rows, dtype), valid, limits))

    if config.fixed_point_step:
        sums = _fixed_point_sums(rows, valid & finite, limits[-1], config.fixed_point_step, weights)
    elif rows[0].shape[0] == 1:
        sums, squared = _one_example_sums(rows, squared, valid, finite, limits, config, dtype, weights)
    else:
        # A multiplier of 0 drops a padding row, unless it holds a NaN or inf (0 * inf is NaN): only then
        # are the rows cleaned. PROPAGATE lets non-finite examples into the sum, as optax.
        dirty = ~finite & ~valid if mode is NonFinite.PROPAGATE else ~finite
        sums, cleaned_squared = _xla_cpu.cond(jnp.any(dirty), clean_then_clip_and_sum, clip_and_sum,
                                              (rows, squared, valid, limits), config.tricks.hoisted_fast_path)
        if mode is NonFinite.ZERO_ENTRIES:  # the statistics are those of the cleaned rows
            squared = cleaned_squared
    counted = valid & finite if mode is NonFinite.ZERO_EXAMPLE else valid
    return dataclasses.replace(
        state,
        sum_chunks=_xla_cpu.add_to_sum_buffers(state.sum_chunks, sums, state.chunk_runs),
        stats=_xla_cpu.add_stats(state.stats, *_statistics(squared, valid, finite, counted, limits, per_layer)),
    )


def _one_example_sums(rows, squared, valid, finite, limits, config, dtype, weights=None):
    """A batch of one example (B = 1): its clipped contribution per layer, ``m * x``, and the squared norms
    the statistics use. The same values as the batch path, written elementwise so that XLA adds them
    straight into the sum buffers: a dot and a cond would each output a buffer the size of the model
    (measured on a 2^26-parameter layer: the batch path's step peaked 1x the update above its state, this
    one 0)."""
    scales, masks, squared = _one_example_scales(rows, squared, valid, finite, limits, config, dtype, weights)
    zero = jnp.zeros((), rows[0].dtype)
    kept = tuple(jnp.where((masks[k] == KEEP) | ((masks[k] == FINITE_ENTRIES) & jnp.isfinite(x[0])), x[0], zero)
                 for k, x in enumerate(rows))
    return tuple(scales[k] * x.astype(dtype) for k, x in enumerate(kept)), squared


KEEP, FINITE_ENTRIES, DROP = 0, 1, 2
"""How a layer of one example enters the sum before its scale: as it is, with its NaN and inf entries as 0,
or not at all (see :class:`ExampleScales`)."""


class ExampleScales(NamedTuple):
    """One example's clipped contribution, layer by layer: layer k adds ``scales[k] * x_k`` in the compute
    dtype, after ``masks[k]`` (``KEEP``, ``FINITE_ENTRIES``: its NaN and inf entries count as 0, or ``DROP``:
    nothing). What :meth:`ClipAccumulator.measure` returns and :func:`add_example` applies.

    >>> totals = [np.zeros(2)]
    >>> add_example(totals, [np.array([3.0, 4.0], np.float32)], ExampleScales(np.array([0.2], np.float32),
    ...                                                                       np.array([KEEP])))
    >>> totals[0].round(6).tolist()  # clipped to norm 1 (0.2 is 0.2 in float32, not in float64)
    [0.6, 0.8]
    """

    scales: jax.Array | np.ndarray  # (K,) compute dtype
    masks: jax.Array | np.ndarray  # (K,) int32


def _one_example_scales(rows, squared, valid, finite, limits, config, dtype, weights=None):
    """``(scales (K,), masks (K,), squared (K, 1))`` of a batch of one example: see :class:`ExampleScales`.

    The squared norms are those the statistics use: with ``ZERO_ENTRIES``, those of the layers with their
    non-finite entries as 0.
    """
    per_layer, mode = config.per_layer, config.non_finite
    k = len(rows)
    groups = k if per_layer else 1
    zero = jnp.zeros((), rows[0].dtype)
    if mode is NonFinite.ZERO_ENTRIES:  # NaN and inf entries count as 0, norms included
        squared = jax.lax.cond(jnp.all(finite), lambda: squared, lambda: _squared_norms(
            tuple(jnp.where(jnp.isfinite(x), x, zero) for x in rows), dtype))
        # A layer whose squared norm is not finite may hold a non-finite entry (masking a finite one is a no-op).
        masks = jnp.where(valid[0], jnp.where(jnp.isfinite(_squared_norms(rows, dtype)[:, 0]), KEEP, FINITE_ENTRIES),
                          DROP)
    else:  # a non-finite example is dropped whole (ZERO_EXAMPLE) or let through (PROPAGATE, as optax)
        keep = valid & finite if mode is NonFinite.ZERO_EXAMPLE else valid
        masks = jnp.broadcast_to(jnp.where(keep[0], KEEP, DROP), (k,))
    multipliers = multiplier(_clip_norms(squared, per_layer), limits[:groups, None], config.rescale_to_unit_norm)
    multipliers = jnp.where(valid, _weighted(multipliers, weights), 0.0).astype(dtype)  # (G, 1)
    scales = multipliers[:, 0] if per_layer else jnp.broadcast_to(multipliers[0, 0], (k,))
    return scales, masks.astype(jnp.int32), squared


def _measure(state, layers, valid, limits, config, weights=None):
    """One example's statistics added into ``state`` (its sums, if any, untouched), and its scales."""
    dtype = limits.dtype  # the compute dtype (the state may have no sums to tell it)
    rows = tuple(x.reshape(x.shape[0], -1) for x in layers)
    squared = _squared_norms(rows, dtype)
    finite = jnp.all(jnp.isfinite(squared), axis=0)
    scales, masks, squared = _one_example_scales(rows, squared, valid, finite, limits, config, dtype, weights)
    counted = valid & finite if config.non_finite is NonFinite.ZERO_EXAMPLE else valid
    stats = _xla_cpu.add_stats(state.stats, *_statistics(squared, valid, finite, counted, limits, config.per_layer))
    return dataclasses.replace(state, stats=stats), ExampleScales(scales, masks)


def add_example(totals: Sequence[np.ndarray], example: Sequence[np.ndarray], scales: ExampleScales,
                piece: int = 1 << 16) -> None:
    """Adds one example's clipped contribution into host totals, in place, a ``piece`` of elements at a time:
    ``totals[k] += fl(scales[k] * x_k)`` after the mask, the product rounded to the compute dtype of
    ``scales`` as the device step rounds it, then added in the totals' dtype (float64). The same values a
    step of that one example adds into a zero delta, which a flush then adds into the totals, without the
    delta: for a large model, one buffer and one pass over it less.

    ``example[k]``: layer k of the example, any shape of ``totals[k].size`` elements (a row ``(1, ...)``
    included).

    >>> totals = [np.zeros(3), np.zeros(2)]
    >>> x = [np.array([3.0, 0.0, 4.0], np.float32), np.array([np.inf, 1.0], np.float32)]
    >>> add_example(totals, x, ExampleScales(np.array([0.5, 2.0], np.float32), np.array([KEEP, FINITE_ENTRIES])))
    >>> totals
    [array([1.5, 0. , 2. ]), array([0., 2.])]
    """
    dtype = np.asarray(scales.scales).dtype
    with np.errstate(invalid="ignore", over="ignore"):  # 0 * inf is NaN and a product may overflow, as on the device
        _add_example(totals, example, scales, dtype, piece)


def _add_example(totals, example, scales, dtype, piece):
    for total, x, scale, mask in zip(totals, example, np.asarray(scales.scales), np.asarray(scales.masks)):
        if mask == DROP:
            continue  # adds zeros (+0.0): the totals, never -0.0, stay as they are
        flat_total, flat_x = total.reshape(-1), np.asarray(x).reshape(-1)
        if flat_x.size != flat_total.size:
            raise ValueError(f"add_example: a layer of {flat_x.size} elements into totals of {flat_total.size}")
        scratch = np.empty(min(piece, flat_x.size), dtype)
        for start in range(0, flat_x.size, piece):
            stop = min(start + piece, flat_x.size)
            product, values = scratch[: stop - start], flat_x[start:stop]
            np.multiply(values, scale, out=product, dtype=dtype)
            if mask == FINITE_ENTRIES:
                np.copyto(product, 0, where=~np.isfinite(values))
            np.add(flat_total[start:stop], product, out=flat_total[start:stop])


def _fixed_point_sums(rows, keep, bound, step: float, weights=None):
    """Per layer ``[sum of hi limbs, sum of lo limbs]`` (int32) of ``rint(m_i x_i / step)`` over the kept rows
    (``m_i`` times the row's weight, if any)."""
    norms = jnp.sqrt(jnp.sum(jnp.stack([_two_stage_squared_norm(x) for x in rows]), axis=0))  # (B,)
    scale = jnp.where(keep, _weighted(multiplier(norms, bound, False), weights), 0.0).astype(jnp.float32)
    out = []
    for x in rows:
        clipped = scale[:, None] * jnp.where(keep[:, None], x.astype(jnp.float32), 0.0)
        grid = jnp.rint(clipped * np.float32(1.0 / step)).astype(jnp.int32)  # exact: |grid| < 2^20
        out.append(jnp.concatenate([jnp.sum(jnp.right_shift(grid, LIMB_BITS), axis=0, dtype=jnp.int32),
                                    jnp.sum(jnp.bitwise_and(grid, (1 << LIMB_BITS) - 1), axis=0, dtype=jnp.int32)]))
    return tuple(out)


def _weighted(multipliers, weights):
    """Each row's multiplier times its weight (``multipliers``: ``(..., B)``); as they are without weights. A
    weight in [0, 1] after the clip keeps the row within its bound."""
    if weights is None:
        return multipliers
    return multipliers * weights.astype(multipliers.dtype)


def _two_stage_squared_norm(x):
    """``(B,)``: each row's squared norm, as blocks of ``norm_blocks`` then the blocks (a barrier keeps them apart)."""
    x = x.astype(jnp.float32)
    n = x.shape[1]
    block = norm_blocks(n)
    padded = jnp.pad(jnp.square(x), ((0, 0), (0, -n % block)))
    partial = jnp.sum(padded.reshape(x.shape[0], -1, block), axis=2)
    return jnp.sum(jax.lax.optimization_barrier(partial), axis=1)


def _statistics(squared, valid, finite, counted, limits, per_layer):
    """A batch's counts (``[examples, non-finite, clip counts, histogram rows]``), norm sums and maxima."""
    k, rows = squared.shape
    groups = k if per_layer else 1
    bounds, example_bound = limits[:groups], limits[groups]
    layer_norms = jnp.sqrt(squared)  # (K, B)
    norms = _clip_norms(squared, per_layer)  # (G, B)
    example_norms = norms[0] if groups == 1 else jnp.sqrt(jnp.sum(squared, axis=0))
    clipped = counted & (norms > bounds[:, None])  # (G, B): a tie is not clipped
    in_stats = counted & jnp.isfinite(layer_norms)  # (K, B)
    example_in_stats = counted & jnp.isfinite(example_norms)  # (B,)
    # Histogram rows: each layer against its bound, then the whole example against the example bound.
    edges = jnp.asarray(RATIO_BUCKETS, squared.dtype)
    layer_bounds = bounds if per_layer else jnp.broadcast_to(bounds[:1], (k,))
    indicators = jnp.concatenate([  # (count slots, B)
        valid[None], (valid & ~finite)[None], jnp.broadcast_to(clipped, (k, rows)),
        _exceedances(in_stats, layer_norms, layer_bounds[:, None] * edges),
        _exceedances(example_in_stats[None], example_norms[None], (example_bound * edges)[None]),
    ])
    stat_norms = jnp.where(in_stats, layer_norms, 0.0)
    counts = jnp.sum(indicators, axis=1, dtype=_xla_cpu.count_dtype(squared.dtype))
    return counts, jnp.sum(stat_norms, axis=1), jnp.max(stat_norms, axis=1)


def _squared_norms(rows: Sequence[jax.Array], dtype: jnp.dtype) -> jax.Array:
    """``(K, B)``: the squared L2 norm of each layer of each example."""
    return jnp.stack([jnp.sum(jnp.square(x.astype(dtype)), axis=1) for x in rows])


def _clip_norms(squared: jax.Array, per_layer: bool) -> jax.Array:
    """``(G, B)``: the norms the bounds apply to (each layer's, or the whole example's)."""
    if per_layer or squared.shape[0] == 1:
        return jnp.sqrt(squared)
    return jnp.sqrt(jnp.sum(squared, axis=0))[None]


def _exceedances(rows, norms, row_edges):
    """``(R * NUM_BUCKETS, B)``: for each histogram row, the counted examples, then those over each edge.

    ``rows``, ``norms``: ``(R, B)``; ``row_edges``: ``(R, E)`` (edge ratio times bound). A norm
    is over an edge when ``norm > edge * bound``: at edge 1.0, exactly the clip test. Summed
    over the batch, these are survival counts; a bucket count is the difference of two.
    """
    over = rows[:, :, None] & (norms[:, :, None] > row_edges[:, None, :])  # (R, B, E)
    counts = jnp.concatenate([rows[:, :, None], over], axis=2)  # (R, B, NUM_BUCKETS)
    return jnp.moveaxis(counts, 1, 2).reshape(-1, rows.shape[1])


_accumulate_jit = jax.jit(_accumulate, static_argnames=("config", "fresh"), donate_argnums=(0,))
_measure_jit = jax.jit(_measure, static_argnames=("config",), donate_argnums=(0,))


@functools.partial(jax.jit, donate_argnums=(0,))
def _zeroed(state):
    """``state`` with every sum and count zero, written over its own (donated) buffers."""
    return jax.tree.map(jnp.zeros_like, state)


@jax.jit
def merge(a: AccumulatorState, b: AccumulatorState) -> AccumulatorState:
    """Combines two partial states of the same aggregation (sums and counts add up).

    Partial sums from several workers or replicas merge into the state that one
    worker would have reached on all their batches (up to float rounding).
    """
    if a.sum_chunks is None or b.sum_chunks is None:
        raise TypeError("merge: a statistics-only state (statistics_only()) holds no sums to add")
    return dataclasses.replace(
        a,  # (fixed point: limbs add as they are; the host decodes them in int64)
        sum_chunks=tuple(x + y for x, y in zip(a.sum_chunks, b.sum_chunks)),
        stats=_xla_cpu.add_stats(a.stats, *_xla_cpu.unpack_stats(b.stats, b.num_layers)),
    )


@dataclasses.dataclass(frozen=True)
class AccumulatorState:
    """Running sums and statistics of one aggregation (a pytree). K = number of layers.

    - ``sum_chunks``: the clipped sums of all layers, flat, in the compute dtype
      (float32; float64 for float64 input); runs of small layers may share a
      buffer (``_xla_cpu.sum_buffer_runs``);
    - ``stats``: the integer counts ``[examples, non-finite, clip counts (K),
      K + 1 histogram rows of NUM_BUCKETS]`` and the K norm sums and maxima,
      packed in one vector or not (``_xla_cpu.stats_zeros``). A histogram row
      (each layer against its bound, then the whole example against the
      example bound) holds the number of norms it counted, then how many of
      them exceed each edge of ``RATIO_BUCKETS``; the bucket counts are the
      differences.

    The properties below decode them, on jax or numpy arrays alike.
    """

    sum_chunks: tuple | None
    stats: jax.Array | np.ndarray | tuple
    layers: tuple[tuple[tuple[int, ...], str], ...]  # static: (shape, sum dtype) per layer
    tricks: Tricks = ALL  # static
    fixed_point_step: float = 0.0  # static: g > 0: each chunk is one layer's int32 limbs [hi..., lo...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def chunk_runs(self) -> tuple[tuple[int, int], ...]:
        sizes = [math.prod(shape) for shape, _ in self.layers]
        return _xla_cpu.sum_buffer_runs(sizes, self.tricks.shared_sum_buffers and not self.fixed_point_step)

    @property
    def sums(self) -> tuple:
        """Per layer: the clipped sum, in its layer's shape and sum dtype (fixed point: float64 numpy, exact)."""
        if self.sum_chunks is None:
            raise TypeError("sums: a statistics-only state (statistics_only()) holds none")
        if self.fixed_point_step:
            return tuple(fixed_point_values(np.asarray(chunk), self.fixed_point_step).reshape(shape)
                         for chunk, (shape, _) in zip(self.sum_chunks, self.layers))
        out = []
        for chunk, (i, j) in zip(self.sum_chunks, self.chunk_runs):
            offset = 0
            for shape, dtype in self.layers[i:j]:
                size = math.prod(shape)
                out.append(chunk[offset : offset + size].reshape(shape).astype(dtype, copy=False))
                offset += size
        return tuple(out)

    @property
    def _counts(self):
        return _xla_cpu.unpack_stats(self.stats, self.num_layers)[0]

    @property
    def example_count(self):
        """Valid examples seen, non-finite ones included."""
        return self._counts[0]

    @property
    def non_finite_count(self):
        """Examples whose squared norm was not finite (NaN or inf entries, or overflow)."""
        return self._counts[1]

    @property
    def clip_counts(self):
        """``(K,)``: examples whose layer k was scaled down (GLOBAL: the same count K times)."""
        return self._counts[2 : 2 + self.num_layers]

    def _histograms(self):
        survival = self._counts[2 + self.num_layers :].reshape(self.num_layers + 1, NUM_BUCKETS)
        # bucket i = (counted over edge i-1) - (counted over edge i); the last one is open.
        xp = np if isinstance(survival, np.ndarray) else jnp
        return survival - xp.concatenate([survival[:, 1:], survival[:, :1] * 0], axis=1)

    @property
    def layer_norm_histogram(self):
        """``(K, NUM_BUCKETS)``: layer norm / layer bound, bucketed by ``RATIO_BUCKETS``."""
        return self._histograms()[:-1]

    @property
    def example_norm_histogram(self):
        """``(NUM_BUCKETS,)``: whole-example norm / example bound."""
        return self._histograms()[-1]

    @property
    def norm_sum(self):
        """``(K,)``: sum of the layer norms of the examples in the statistics (for the mean)."""
        return _xla_cpu.unpack_stats(self.stats, self.num_layers)[1]

    @property
    def norm_max(self):
        """``(K,)``: largest layer norm seen."""
        return _xla_cpu.unpack_stats(self.stats, self.num_layers)[2]

    def statistics_only(self) -> AccumulatorState:
        """The same state without its sums (cheap to copy to the host)."""
        return dataclasses.replace(self, sum_chunks=None)


jax.tree_util.register_dataclass(
    AccumulatorState, data_fields=["sum_chunks", "stats"], meta_fields=["layers", "tricks", "fixed_point_step"])


def fixed_point_values(limbs: np.ndarray, step: float) -> np.ndarray:
    """``(hi * 2^LIMB_BITS + lo) * step`` in float64 from one layer's limbs ``[hi..., lo...]``, decoded in int64.

    Exact while ``|hi * 2^LIMB_BITS + lo| < 2^53``.

    >>> fixed_point_values(np.array([1, -1, 5, 1023], np.int32), 0.25).tolist()  # 1029 and -1 steps
    [257.25, -0.25]
    """
    hi, lo = np.split(limbs.astype(np.int64), 2)
    return (hi * (1 << LIMB_BITS) + lo).astype(np.float64) * step


def _sum_dtype(dtype: str) -> jnp.dtype:
    """float32 for 16- and 32-bit and integer input, float64 for float64 (with x64 on)."""
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.promote_types(jnp.dtype(dtype), jnp.float32)
    return jnp.dtype(jnp.float32)


@functools.lru_cache(maxsize=256)
def _zeros_program(chunk_shapes: tuple[tuple[int, np.dtype], ...] | None, slots: int, k: int, float_dtype: np.dtype,
                   packed: bool):
    """One compiled program that makes an empty state's zero sum chunks and statistics on the default device: one
    dispatch (tens of microseconds) where a ``jnp.zeros`` each costs about 0.2 ms (a DP-SGD step makes one state
    per step)."""
    def zeros():
        chunks = None if chunk_shapes is None else tuple(jnp.zeros((n,), dtype) for n, dtype in chunk_shapes)
        return chunks, _xla_cpu.stats_zeros(slots, k, float_dtype, packed)

    return jax.jit(zeros)


class ClipAccumulator:
    """Clips a stream of per-example batches and keeps the sum, for one layer spec and policy.

    ``tricks`` switches ``_xla_cpu``'s layout tricks (for benchmarks; the results are the same).

    Example:
      >>> import numpy as np
      >>> acc = ClipAccumulator([LayerSpec("w", (3,))], ClipPolicy(l2_norm_clip=1.25))
      >>> batch = [np.array([[0, 0, 0], [0, 3, 4], [4, 0, 3], [3, 4, 0]], np.float32)]
      >>> state = acc.update(acc.init(), batch, np.ones(4, bool))
      >>> state.sums[0], int(state.clip_counts[0]), int(state.example_count)
      (Array([1.75, 1.75, 1.75], dtype=float32), 3, 4)
    """

    def __init__(self, layers: Sequence[LayerSpec], policy: ClipPolicy, tricks: Tricks = ALL,
                 fixed_point_step: float = 0.0) -> None:
        if not layers:
            raise ValueError("ClipAccumulator: at least one layer is needed.")
        if fixed_point_step and (policy.is_per_layer or policy.rescale_to_unit_norm
                                 or policy.non_finite is not NonFinite.ZERO_EXAMPLE):
            raise ValueError("fixed point: a GLOBAL bound without rescaling, non-finite examples zeroed")
        if fixed_point_step and not policy.l2_norm_clip / fixed_point_step <= FIXED_POINT_RANGE / 2:
            raise ValueError(f"fixed point: a step of {fixed_point_step} is too fine for the bound"
                             f" {policy.l2_norm_clip} (at most 2^19 steps in the bound)")
        self.layers = tuple(LayerSpec(n, tuple(s), str(np.dtype(d))) for n, s, d in layers)
        self.policy = policy
        self.sum_dtypes = tuple(_sum_dtype(layer.dtype) for layer in self.layers)
        self.compute_dtype = jnp.result_type(*self.sum_dtypes)
        self.bounds = tuple(policy.layer_bounds(self.layers))
        groups = self.bounds if policy.is_per_layer else self.bounds[:1]
        limits: list[float | np.float32] = [*groups, policy.example_bound(self.layers)]
        if fixed_point_step:  # the bound the fixed-point multiplier uses, last
            limits.append(conservative_bound(policy.l2_norm_clip, [layer.size for layer in self.layers]))
        self._limits = jnp.asarray(limits, self.compute_dtype)
        self.fixed_point_step = float(fixed_point_step)
        self._config = _StepConfig(policy.is_per_layer, policy.rescale_to_unit_norm, policy.non_finite, tricks,
                                   self.fixed_point_step)

    def on_support(self, widths: Sequence[int]) -> ClipAccumulator:
        """This accumulator's clip for rows that hold ``widths[k]`` of each layer's coordinates: the same bounds
        (computed for the whole layers: a proportional bound keeps its layer's share), the same step and
        options; each layer a flat ``(widths[k],)``. A row whose other coordinates are zero has the same norms
        here as in the whole model, so it is clipped and summed as the whole row would be, at a fraction of
        the cost (an audit's canaries: ``server.canaries``).

        >>> acc = ClipAccumulator([LayerSpec("w", (4, 4)), LayerSpec("b", (4,))],
        ...                       ClipPolicy("per_layer_proportional", l2_norm_clip=1.0))
        >>> small = acc.on_support([1, 1])
        >>> [layer.shape for layer in small.layers], small.bounds == acc.bounds
        ([(1,), (1,)], True)
        >>> state = small.update(small.init(), [np.array([[30.0]], np.float32), np.array([[40.0]], np.float32)],
        ...                      np.ones(1, bool))
        >>> [round(float(s[0]), 4) for s in state.sums], [round(b, 4) for b in acc.bounds]
        ([0.8944, 0.4472], [0.8944, 0.4472])
        """
        if len(widths) != len(self.layers) or any(w < 1 for w in widths):
            raise ValueError(f"on_support: {len(self.layers)} widths of at least 1, got {list(widths)}")
        restricted = copy.copy(self)
        restricted.layers = tuple(LayerSpec(layer.name, (int(w),), layer.dtype)
                                  for layer, w in zip(self.layers, widths))
        return restricted

    def init(self, sums: bool = True) -> AccumulatorState:
        """An empty state: zero sums and counts (``sums=False``: counts only, for :meth:`measure`)."""
        k, tricks = len(self.layers), self._config.tricks
        sizes = [layer.size for layer in self.layers]
        if not sums:
            chunk_shapes = None
        elif self.fixed_point_step:
            chunk_shapes = tuple((2 * size, np.dtype(np.int32)) for size in sizes)
        else:
            chunk_shapes = tuple((sum(sizes[i:j]), np.dtype(self.compute_dtype))
                                 for i, j in _xla_cpu.sum_buffer_runs(sizes, tricks.shared_sum_buffers))
        chunks, stats = _zeros_program(chunk_shapes, 2 + k + (k + 1) * NUM_BUCKETS, k, np.dtype(self.compute_dtype),
                                       tricks.packed_stats)()
        return AccumulatorState(
            sum_chunks=chunks,
            stats=stats,
            layers=tuple((layer.shape, str(np.dtype(dt))) for layer, dt in zip(self.layers, self.sum_dtypes)),
            tricks=tricks, fixed_point_step=self.fixed_point_step,
        )

    @staticmethod
    def reset(state: AccumulatorState) -> AccumulatorState:
        """``init()``'s empty state in ``state``'s own buffers (donated: do not use ``state`` afterwards).

        A large model's delta restarts from zero after every flush; a fresh
        ``init()`` would fault in a new buffer the size of the model each time.
        """
        return _zeroed(state)

    def update(
        self, state: AccumulatorState, batch: Sequence[jax.Array | np.ndarray], valid: jax.Array | np.ndarray,
        fresh: bool = False, weights: jax.Array | np.ndarray | None = None,
    ) -> AccumulatorState:
        """Adds one batch: ``batch[k]`` has shape ``(B, *layers[k].shape)``, ``valid`` shape ``(B,)``.

        ``state`` is donated: do not use it afterwards. Rows where ``valid`` is
        False contribute exactly zero and are not counted, whatever they hold.
        ``fresh``: the result is ``update(init(), batch, valid)``, written into
        ``state``'s buffers without reading them (a delta just flushed needs no
        zeroing pass first: for a large model that pass is as long as the step).
        ``weights``: ``(B,)`` factors in [0, 1], each row's clipped contribution times its weight (FedBuff's
        staleness weights: the sensitivity stays the bound); the statistics are the unweighted rows'.

        >>> acc = ClipAccumulator([LayerSpec("w", (2,))], ClipPolicy(l2_norm_clip=1.0))
        >>> rows = [np.array([[3.0, 4.0], [0.3, 0.4]], np.float32)]
        >>> acc.update(acc.init(), rows, np.ones(2, bool), weights=np.array([0.5, 1.0], np.float32)).sums[0]
        Array([0.6, 0.8], dtype=float32)
        """
        if weights is not None:
            weights = np.asarray(weights, np.float32)
        return _accumulate_jit(state, tuple(batch), valid, self._limits, self._config, fresh, weights)

    def measure(self, state: AccumulatorState, example: Sequence[jax.Array | np.ndarray],
                valid: jax.Array | np.ndarray, weights: jax.Array | np.ndarray | None = None
                ) -> tuple[AccumulatorState, ExampleScales]:
        """One example (``example[k]`` of shape ``(1, *layers[k].shape)``) measured but not summed: its
        statistics go into ``state`` (donated; its sums, if it has any, are left as they are) and its
        per-layer scales come back, for :func:`add_example` to add its clipped contribution into host totals.

        ``update(init(), example, valid)``'s sums, then added into float64 totals, are what
        ``add_example(totals, example, scales)`` adds; the step reads the example once (its norms) and writes
        nothing the size of the model. Not for fixed-point accumulators (their sums are integers on a grid).
        ``weights``: as :meth:`update`'s (the scales carry the example's weight).

        >>> acc = ClipAccumulator([LayerSpec("w", (2,))], ClipPolicy(l2_norm_clip=1.0))
        >>> state, scales = acc.measure(acc.init(sums=False), [np.array([[3.0, 4.0]], np.float32)], np.ones(1, bool))
        >>> scales.scales, int(state.clip_counts[0]), int(state.example_count)
        (Array([0.2], dtype=float32), 1, 1)
        """
        if self.fixed_point_step:
            raise ValueError("measure: a fixed-point accumulator sums on its grid (use update)")
        if weights is not None:
            weights = np.asarray(weights, np.float32)
        return _measure_jit(state, tuple(example), valid, self._limits, self._config, weights)

    def compile(self, rows: int, kind: str = "sum", weighted: bool = False) -> None:
        """Compiles the step for batches of ``rows`` rows ahead of time, from shapes alone: the first
        :meth:`update` (``kind`` ``"sum"`` or ``"fresh"``) or :meth:`measure` (``"measure"``) of that size,
        on the same default device, with numpy batches, then runs without compiling. No batch is made or read:
        for a large model, running the step once on zeros would fault in and read a model's worth of memory.
        ``weighted``: the step for batches that carry weights.

        >>> acc = ClipAccumulator([LayerSpec("w", (2,))], ClipPolicy(l2_norm_clip=1.0))
        >>> acc.compile(4, "measure")
        """
        if kind not in ("sum", "fresh", "measure"):
            raise ValueError(f"compile: kind is 'sum', 'fresh' or 'measure', not {kind!r}")
        batch = tuple(jax.ShapeDtypeStruct((rows, *layer.shape), np.dtype(layer.dtype)) for layer in self.layers)
        valid = jax.ShapeDtypeStruct((rows,), np.dtype(bool))
        weights = jax.ShapeDtypeStruct((rows,), np.dtype(np.float32)) if weighted else None
        if kind == "measure":
            _measure_jit.lower(self.init(sums=False), batch, valid, self._limits, self._config, weights).compile()
        else:
            _accumulate_jit.lower(self.init(), batch, valid, self._limits, self._config, kind == "fresh",
                                  weights).compile()

    merge = staticmethod(merge)

    def program_key(self, rows: int, kind: str = "sum") -> tuple:
        """What the compiled step for batches of ``rows`` rows depends on (not the layer names, not
        the bounds' values): two accumulators with equal keys run the same program. ``kind``: ``"sum"``
        (:meth:`update`), ``"fresh"`` (``update(..., fresh=True)``) or ``"measure"`` (:meth:`measure`)."""
        shapes = tuple((layer.shape, layer.dtype) for layer in self.layers)
        return (self._config, shapes, self._limits.shape, str(self.compute_dtype), rows, kind)

    @staticmethod
    def compiled_programs() -> int:
        """How many step programs have been compiled so far in this process."""
        return _accumulate_jit._cache_size()  # type: ignore[attr-defined]  # jax's own, not in its JitWrapped stub
