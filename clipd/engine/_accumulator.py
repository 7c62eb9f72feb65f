"""The streaming clip-and-sum accumulator that the service runs on its device.

One jitted, fused step per batch: per-example (or per-layer) norms, the clip
multipliers, and ``sum += multipliers @ batch`` for every layer, plus clip
counts and norm statistics. The state is donated, so the sums are updated in
place. Batches have a fixed padded size with a ``valid`` mask: padding rows
contribute exactly zero whatever they hold, so a few batch sizes are compiled
once and never again.

The multiplier of an example (or of one layer of it, for per-layer bounds)
with norm ``n`` and bound ``c`` is optax's ``nan_to_num(min(c / n, 1), nan=1)``;
with ``rescale_to_unit_norm`` it is jax_privacy's ``min(1, c/n) / c`` (or
``1/n`` when ``c = 0``, NaN and +inf becoming 0). An example is counted as
clipped when ``n > c``: a tie is not clipped, as in optax and jax_privacy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._policy import ClipPolicy, LayerSpec, NonFinite

RATIO_BUCKETS: tuple[float, ...] = (
    1 / 64, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 0.9, 1.0, 1.1, 1.5, 2.0, 4.0, 8.0, 16.0, 64.0,
)
"""Upper edges of the norm histogram, as ratios ``norm / bound``; a last bucket holds the rest.

Bucket ``i`` counts ``RATIO_BUCKETS[i-1] < norm / bound <= RATIO_BUCKETS[i]``, so the
bucket ending at 1.0 holds the examples that were not clipped (ties included).
"""
NUM_BUCKETS = len(RATIO_BUCKETS) + 1


@dataclasses.dataclass(frozen=True)
class AccumulatorState:
    """Running sums and statistics of one aggregation (a pytree). K = number of layers.

    Few buffers, so that a step writes few outputs (on the CPU, XLA runs a program
    of at most 8 kernels inline; more go through a thread pool that costs more than
    the math on small batches):

    - ``sum_chunks``: the clipped sums of all layers, flat, one after the other, in
      the compute dtype (float32; float64 for float64 input); runs of small layers
      share a buffer (see ``sum_buffer_runs``);
    - ``stats``: integers ``[examples, non-finite, clip counts (K), K + 1 histogram
      rows of NUM_BUCKETS, then the bits of K norm sums and K norm maxima]``. A
      histogram row (each layer against its bound, then the whole example against
      the example bound) holds the number of norms it counted, then how many of
      them exceed each edge of ``RATIO_BUCKETS`` (a survival count: a step adds one
      reduction, the bucket counts are its differences).

    The properties below decode them, on jax or numpy arrays alike.
    """

    sum_chunks: tuple | None
    stats: jax.Array | np.ndarray
    layers: tuple[tuple[tuple[int, ...], str], ...]  # static: (shape, sum dtype) per layer

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def chunk_runs(self) -> tuple[tuple[int, int], ...]:
        return sum_buffer_runs([math.prod(shape) for shape, _ in self.layers])

    @property
    def sums(self) -> tuple:
        """Per layer: the clipped sum, in its layer's shape and sum dtype."""
        out = []
        for chunk, (i, j) in zip(self.sum_chunks, self.chunk_runs):
            offset = 0
            for shape, dtype in self.layers[i:j]:
                size = math.prod(shape)
                out.append(chunk[offset : offset + size].reshape(shape).astype(dtype))
                offset += size
        return tuple(out)

    @property
    def example_count(self):
        """Valid examples seen, non-finite ones included."""
        return self.stats[0]

    @property
    def non_finite_count(self):
        """Examples whose squared norm was not finite (NaN or inf entries, or overflow)."""
        return self.stats[1]

    @property
    def clip_counts(self):
        """``(K,)``: examples whose layer k was scaled down (GLOBAL: the same count K times)."""
        return self.stats[2 : 2 + self.num_layers]

    def _histograms(self):
        k = self.num_layers
        survival = self.stats[2 + k : _count_slots(k)].reshape(k + 1, NUM_BUCKETS)
        # bucket i = (counted over edge i-1) - (counted over edge i); the last one is open.
        return survival - _concat(survival[:, 1:], survival[:, :1] * 0, axis=1)

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
        n = _count_slots(self.num_layers)
        return _bits_to_float(self.stats[n : n + self.num_layers])

    @property
    def norm_max(self):
        """``(K,)``: largest layer norm seen."""
        return _bits_to_float(self.stats[_count_slots(self.num_layers) + self.num_layers :])

    def statistics_only(self) -> AccumulatorState:
        """The same state without its sums (cheap to copy to the host)."""
        return dataclasses.replace(self, sum_chunks=None)


jax.tree_util.register_dataclass(AccumulatorState, data_fields=["sum_chunks", "stats"], meta_fields=["layers"])


def _count_slots(k: int) -> int:
    """Length of the integer part of ``stats`` for K layers."""
    return 2 + k + (k + 1) * NUM_BUCKETS


def _concat(*arrays, axis=0):
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np.concatenate(arrays, axis=axis)
    return jnp.concatenate(arrays, axis=axis)


_FLOAT_OF_INT = {np.dtype(np.int32): np.float32, np.dtype(np.int64): np.float64}
_INT_OF_FLOAT = {np.dtype(np.float32): np.int32, np.dtype(np.float64): np.int64}


def _bits_to_float(bits):
    dtype = _FLOAT_OF_INT[np.dtype(bits.dtype)]
    if isinstance(bits, np.ndarray):
        return np.ascontiguousarray(bits).view(dtype)
    return jax.lax.bitcast_convert_type(bits, dtype)


def _float_to_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, _INT_OF_FLOAT[np.dtype(x.dtype)])


class _StepConfig(NamedTuple):
    """The static part of a step: what changes the compiled program (a tuple: cheap to hash)."""

    per_layer: bool
    rescale_to_unit_norm: bool
    non_finite: NonFinite


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


def _row_squared_norms(flat: Sequence[jax.Array], dtype: jnp.dtype) -> jax.Array:
    """``(K, B)``: the squared L2 norm of each layer of each example."""
    return jnp.stack([jnp.sum(jnp.square(x.astype(dtype)), axis=1) for x in flat])


def _clip_norms(squared: jax.Array, per_layer: bool) -> jax.Array:
    """``(G, B)``: the norms the bounds apply to (each layer's, or the whole example's)."""
    if per_layer or squared.shape[0] == 1:
        return jnp.sqrt(squared)
    return jnp.sqrt(jnp.sum(squared, axis=0))[None]


def _clipped_sums(flat, squared, keep, bounds, config, dtype) -> jax.Array:
    """Per layer: the multiplier-weighted column sum of its ``(B, n_k)`` rows."""
    factors = multiplier(_clip_norms(squared, config.per_layer), bounds[:, None], config.rescale_to_unit_norm)
    factors = jnp.where(keep, factors, 0.0).astype(dtype)
    sums = []
    for k, x in enumerate(flat):
        if sums:  # one dot after the other: two at once share the memory bandwidth and run slower
            x, _ = jax.lax.optimization_barrier((x, sums[-1]))
        # Full float32 precision on every backend (GPUs would otherwise round the inputs to TF32).
        sums.append(jnp.tensordot(factors[k if config.per_layer else 0], x.astype(dtype), axes=1,
                                  precision=jax.lax.Precision.HIGHEST))
    return tuple(sums)


CHUNK_ELEMENTS = 1 << 16
"""Consecutive layers smaller than this share one sum buffer (one add per step instead of many)."""


def sum_buffer_runs(sizes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Runs ``(first, end)`` of consecutive layers that share a sum buffer.

    Small layers are packed together up to ``CHUNK_ELEMENTS``; a larger layer has
    its own buffer (adding a packed dot output costs a copy, which only pays off
    for small layers).

    >>> sum_buffer_runs([10, 20, 70_000, 5, 5])
    ((0, 2), (2, 3), (3, 5))
    """
    runs, first, total = [], 0, 0
    for k, size in enumerate(sizes):
        if k > first and total + size > CHUNK_ELEMENTS:
            runs.append((first, k))
            first, total = k, 0
        total += size
    runs.append((first, len(sizes)))
    return tuple(runs)


def _combine_stats(stats, counts, norm_sum, norm_max):
    """``stats`` plus a step's (or another state's) counts, norm sums and norm maxima.

    One elementwise select over the whole vector, so that XLA updates it in place.
    """
    n, k = counts.shape[0], norm_sum.shape[0]
    floats = _bits_to_float(stats)
    zeros = jnp.zeros((k,), floats.dtype)
    summed = _float_to_bits(floats + jnp.concatenate([jnp.zeros((n,), floats.dtype), norm_sum, zeros]))
    maxed = _float_to_bits(jnp.maximum(floats, jnp.concatenate([jnp.zeros((n + k,), floats.dtype), norm_max])))
    counted = stats + jnp.concatenate([counts.astype(stats.dtype), jnp.zeros((2 * k,), stats.dtype)])
    slot = jnp.arange(stats.shape[0])
    return jnp.where(slot < n, counted, jnp.where(slot < n + k, summed, maxed))


def _accumulate(state, layers, valid, limits, config):
    """One step. ``limits``: ``[bounds (G), example bound]``, G = K per layer, 1 global."""
    k = len(layers)
    groups = k if config.per_layer else 1
    bounds, example_bound = limits[:groups], limits[groups]
    dtype = state.sum_chunks[0].dtype
    flat = tuple(x.reshape(x.shape[0], -1) for x in layers)
    squared = _row_squared_norms(flat, dtype)
    finite_rows = jnp.all(jnp.isfinite(squared), axis=0)
    # PROPAGATE lets non-finite examples into the sum (only padding must not leak in); ZERO_ENTRIES
    # counts them once cleaned; ZERO_EXAMPLE drops them.
    needs_cleaning = ~finite_rows & ~valid if config.non_finite is NonFinite.PROPAGATE else ~finite_rows
    counted = valid & finite_rows if config.non_finite is NonFinite.ZERO_EXAMPLE else valid

    # The usual case, computed unconditionally (inside a lax.cond branch XLA's CPU backend runs the
    # dots about 2x slower): a 0 multiplier is enough when no masked or dropped row is non-finite.
    fast = _clipped_sums(flat, squared, valid, bounds, config, dtype)

    def cleaned(operands):  # rare: select the entries to keep first (one more pass)
        flat, squared, valid, limits = operands
        if config.non_finite is NonFinite.ZERO_ENTRIES:
            flat = tuple(jnp.where(valid[:, None] & jnp.isfinite(x), x, jnp.zeros((), x.dtype)) for x in flat)
        else:
            keep = valid
            if config.non_finite is NonFinite.ZERO_EXAMPLE:
                keep = valid & jnp.all(jnp.isfinite(squared), axis=0)
            flat = tuple(jnp.where(keep[:, None], x, jnp.zeros((), x.dtype)) for x in flat)
        squared = _row_squared_norms(flat, dtype)
        return _clipped_sums(flat, squared, valid, limits[:groups], config, dtype), squared

    contributions, cleaned_squared = jax.lax.cond(
        jnp.any(needs_cleaning), cleaned, lambda _: (fast, squared), (flat, squared, valid, limits)
    )
    if config.non_finite is NonFinite.ZERO_ENTRIES:  # the statistics are those of the cleaned rows
        squared = cleaned_squared

    layer_norms = jnp.sqrt(squared)  # (K, B)
    norms = _clip_norms(squared, config.per_layer)  # (G, B)
    example_norms = norms[0] if groups == 1 else jnp.sqrt(jnp.sum(squared, axis=0))
    clipped = jnp.broadcast_to(counted & (norms > bounds[:, None]), (k, valid.shape[0]))
    # Histogram rows: each layer against its bound, then the whole example against the example
    # bound. A row holds its count, then how many exceed each edge e (norm > e * bound: at e = 1
    # exactly the clip test).
    edges = jnp.asarray(RATIO_BUCKETS, dtype)
    in_stats = counted & jnp.isfinite(layer_norms)  # (K, B)
    layer_edges = (bounds if config.per_layer else jnp.broadcast_to(bounds[:1], (k,)))[:, None] * edges
    example_rows = counted & jnp.isfinite(example_norms)  # (B,)

    def survival(rows, norms, row_edges):  # (R, B), (R, B), (R, E) -> (R * NUM_BUCKETS, B)
        exceeds = rows[:, :, None] & (norms[:, :, None] > row_edges[:, None, :])  # (R, B, E)
        counts = jnp.concatenate([rows[:, :, None], exceeds], axis=2)  # (R, B, NUM_BUCKETS)
        return jnp.moveaxis(counts, 1, 2).reshape(-1, rows.shape[1])

    indicators = jnp.concatenate([
        valid[None], (valid & ~finite_rows)[None], clipped,
        survival(in_stats, layer_norms, layer_edges),
        survival(example_rows[None], example_norms[None], (example_bound * edges)[None]),
    ])  # (count slots, B)
    stat_norms = jnp.where(in_stats, layer_norms, 0.0)
    return dataclasses.replace(
        state,
        sum_chunks=tuple(
            chunk + (jnp.concatenate(contributions[i:j]) if j - i > 1 else contributions[i])
            for chunk, (i, j) in zip(state.sum_chunks, state.chunk_runs)
        ),
        stats=_combine_stats(
            state.stats, jnp.sum(indicators, axis=1, dtype=state.stats.dtype),
            jnp.sum(stat_norms, axis=1), jnp.max(stat_norms, axis=1),
        ),
    )


_accumulate_jit = jax.jit(_accumulate, static_argnames=("config",), donate_argnums=(0,))


@jax.jit
def merge(a: AccumulatorState, b: AccumulatorState) -> AccumulatorState:
    """Combines two partial states of the same aggregation (sums and counts add up).

    Partial sums from several workers or replicas merge into the state that one
    worker would have reached on all their batches (up to float rounding).
    """
    k = a.num_layers
    n = _count_slots(k)
    return dataclasses.replace(
        a,
        sum_chunks=tuple(x + y for x, y in zip(a.sum_chunks, b.sum_chunks)),
        stats=_combine_stats(a.stats, b.stats[:n], b.norm_sum, b.norm_max),
    )


def _sum_dtype(dtype: str) -> jnp.dtype:
    """float32 for 16- and 32-bit and integer input, float64 for float64 (with x64 on)."""
    return jnp.promote_types(jnp.dtype(dtype), jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else jnp.dtype(jnp.float32)


class ClipAccumulator:
    """Clips a stream of per-example batches and keeps the sum, for one layer spec and policy.

    Example:
      >>> import numpy as np
      >>> acc = ClipAccumulator([LayerSpec("w", (3,))], ClipPolicy(l2_norm_clip=1.25))
      >>> batch = [np.array([[0, 0, 0], [0, 3, 4], [4, 0, 3], [3, 4, 0]], np.float32)]
      >>> state = acc.update(acc.init(), batch, np.ones(4, bool))
      >>> state.sums[0], int(state.clip_counts[0]), int(state.example_count)
      (Array([1.75, 1.75, 1.75], dtype=float32), 3, 4)
    """

    def __init__(self, layers: Sequence[LayerSpec], policy: ClipPolicy) -> None:
        if not layers:
            raise ValueError("ClipAccumulator: at least one layer is needed.")
        self.layers = tuple(LayerSpec(n, tuple(s), str(np.dtype(d))) for n, s, d in layers)
        self.policy = policy
        self.sum_dtypes = tuple(_sum_dtype(layer.dtype) for layer in self.layers)
        self.compute_dtype = jnp.result_type(*self.sum_dtypes)
        self.bounds = tuple(policy.layer_bounds(self.layers))
        groups = self.bounds if policy.is_per_layer else self.bounds[:1]
        self._limits = jnp.asarray([*groups, policy.example_bound(self.layers)], self.compute_dtype)
        self._config = _StepConfig(policy.is_per_layer, policy.rescale_to_unit_norm, policy.non_finite)

    def init(self) -> AccumulatorState:
        """An empty state: zero sums and counts."""
        k = len(self.layers)
        return AccumulatorState(
            sum_chunks=tuple(
                jnp.zeros((sum(layer.size for layer in self.layers[i:j]),), self.compute_dtype)
                for i, j in sum_buffer_runs([layer.size for layer in self.layers])
            ),
            stats=jnp.zeros((_count_slots(k) + 2 * k,), _INT_OF_FLOAT[np.dtype(self.compute_dtype)]),
            layers=tuple((layer.shape, str(np.dtype(dt))) for layer, dt in zip(self.layers, self.sum_dtypes)),
        )

    def update(
        self, state: AccumulatorState, batch: Sequence[jax.Array], valid: jax.Array
    ) -> AccumulatorState:
        """Adds one batch: ``batch[k]`` has shape ``(B, *layers[k].shape)``, ``valid`` shape ``(B,)``.

        ``state`` is donated: do not use it afterwards. Rows where ``valid`` is
        False contribute exactly zero and are not counted, whatever they hold.
        """
        return _accumulate_jit(state, tuple(batch), valid, self._limits, self._config)

    merge = staticmethod(merge)

    def program_key(self, rows: int) -> tuple:
        """What the compiled step for batches of ``rows`` rows depends on (not the layer names, not
        the bounds' values): two accumulators with equal keys run the same program."""
        shapes = tuple((layer.shape, layer.dtype) for layer in self.layers)
        return (self._config, shapes, self._limits.shape, str(self.compute_dtype), rows)

    @staticmethod
    def compiled_programs() -> int:
        """How many step programs have been compiled so far in this process."""
        return _accumulate_jit._cache_size()
