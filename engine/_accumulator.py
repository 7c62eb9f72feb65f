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
import functools
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


class AccumulatorState(NamedTuple):
    """Running sums and statistics of one aggregation (a pytree). K = number of layers."""

    sums: tuple[jax.Array, ...]  # per layer: its shape, float32 (float64 for float64 input)
    example_count: jax.Array  # () int32: valid examples seen, non-finite ones included
    clip_counts: jax.Array  # (K,) int32: examples whose layer k was scaled down
    non_finite_count: jax.Array  # () int32: examples with a non-finite squared norm
    norm_sum: jax.Array  # (K,) float32: sum of the layer norms (for the mean)
    norm_max: jax.Array  # (K,) float32: largest layer norm
    layer_norm_histogram: jax.Array  # (K, NUM_BUCKETS) int32: layer norm / layer bound
    example_norm_histogram: jax.Array  # (NUM_BUCKETS,) int32: example norm / example bound


@dataclasses.dataclass(frozen=True)
class _StepConfig:
    """The static part of a step: what changes the compiled program."""

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


def _histogram(ratios: jax.Array, rows: jax.Array) -> jax.Array:
    """Counts of ``ratios[..., b]`` per bucket over the rows where ``rows`` is True."""
    edges = jnp.asarray(RATIO_BUCKETS, ratios.dtype)
    index = jnp.searchsorted(edges, ratios, side="left")
    one_hot = jax.nn.one_hot(index, NUM_BUCKETS, dtype=jnp.int32)
    return jnp.sum(one_hot * rows[..., None], axis=-2, dtype=jnp.int32)


def _ratio(norm: jax.Array, bound: jax.Array) -> jax.Array:
    return jnp.where(norm == 0, 0.0, norm / bound)


def _row_squared_norms(flat: Sequence[jax.Array], dtype: jnp.dtype) -> jax.Array:
    """``(K, B)``: the squared L2 norm of each layer of each example."""
    return jnp.stack([jnp.sum(jnp.square(x.astype(dtype)), axis=1) for x in flat])


def _clip_and_sum(flat, squared, valid, bounds, config, sum_dtypes):
    """Clip multipliers and the multiplier-weighted column sums of every layer."""
    if config.per_layer:
        norms = jnp.sqrt(squared)  # (K, B)
    else:
        norms = jnp.sqrt(jnp.sum(squared, axis=0))[None]  # (1, B)
    factors = multiplier(norms, bounds[:, None], config.rescale_to_unit_norm)
    factors = jnp.where(valid, factors, 0.0)
    contributions = tuple(
        jnp.tensordot(factors[k if config.per_layer else 0].astype(dt), x.astype(dt), axes=1)
        for k, (x, dt) in enumerate(zip(flat, sum_dtypes))
    )
    return contributions, norms


def _accumulate(state, layers, valid, bounds, example_bound, config):
    compute_dtype = state.norm_sum.dtype
    sum_dtypes = tuple(s.dtype for s in state.sums)
    flat = tuple(x.reshape(x.shape[0], -1) for x in layers)
    squared = _row_squared_norms(flat, compute_dtype)
    finite_rows = jnp.all(jnp.isfinite(squared), axis=0)
    if config.non_finite is NonFinite.PROPAGATE:
        needs_cleaning = ~finite_rows & ~valid  # only padding may not leak into the sum
        keep = lambda x: valid[:, None]  # noqa: E731
    elif config.non_finite is NonFinite.ZERO_EXAMPLE:
        needs_cleaning = ~finite_rows
        keep = lambda x: (valid & finite_rows)[:, None]  # noqa: E731
    else:
        needs_cleaning = ~finite_rows
        keep = lambda x: valid[:, None] & jnp.isfinite(x)  # noqa: E731

    def fast(flat):  # no row needs cleaning: a 0 multiplier is enough
        return _clip_and_sum(flat, squared, valid, bounds, config, sum_dtypes)

    def cleaned(flat):  # rare: select the entries to keep first (one more pass)
        flat = tuple(jnp.where(keep(x), x, jnp.zeros((), x.dtype)) for x in flat)
        return _clip_and_sum(
            flat, _row_squared_norms(flat, compute_dtype), valid, bounds, config, sum_dtypes
        )

    contributions, norms = jax.lax.cond(jnp.any(needs_cleaning), cleaned, fast, flat)

    counted = valid if config.non_finite is not NonFinite.ZERO_EXAMPLE else valid & finite_rows
    clipped = counted & (norms > bounds[:, None])  # (G, B)
    clip_counts = jnp.sum(clipped, axis=1, dtype=jnp.int32)
    layer_norms = norms if config.per_layer else jnp.sqrt(squared)
    if not config.per_layer:
        clip_counts = jnp.broadcast_to(clip_counts, (len(flat),))
        example_norms = norms[0]
    else:
        example_norms = jnp.sqrt(jnp.sum(jnp.square(norms), axis=0))
    layer_bounds = bounds[:, None] if config.per_layer else bounds[0]
    in_stats = counted & jnp.isfinite(layer_norms)  # (K, B)
    example_in_stats = counted & jnp.isfinite(example_norms)
    return AccumulatorState(
        sums=tuple(s + c.reshape(s.shape) for s, c in zip(state.sums, contributions)),
        example_count=state.example_count + jnp.sum(valid, dtype=jnp.int32),
        clip_counts=state.clip_counts + clip_counts,
        non_finite_count=state.non_finite_count + jnp.sum(valid & ~finite_rows, dtype=jnp.int32),
        norm_sum=state.norm_sum + jnp.sum(jnp.where(in_stats, layer_norms, 0.0), axis=1),
        norm_max=jnp.maximum(state.norm_max, jnp.max(jnp.where(in_stats, layer_norms, 0.0), axis=1)),
        layer_norm_histogram=state.layer_norm_histogram
        + _histogram(_ratio(layer_norms, layer_bounds), in_stats),
        example_norm_histogram=state.example_norm_histogram
        + _histogram(_ratio(example_norms, example_bound), example_in_stats),
    )


_accumulate_jit = jax.jit(_accumulate, static_argnames=("config",), donate_argnums=(0,))


def merge(a: AccumulatorState, b: AccumulatorState) -> AccumulatorState:
    """Combines two partial states of the same aggregation (sums and counts add up).

    Partial sums from several workers or replicas merge into the state that one
    worker would have reached on all their batches (up to float rounding).
    """
    return AccumulatorState(
        sums=tuple(x + y for x, y in zip(a.sums, b.sums)),
        example_count=a.example_count + b.example_count,
        clip_counts=a.clip_counts + b.clip_counts,
        non_finite_count=a.non_finite_count + b.non_finite_count,
        norm_sum=a.norm_sum + b.norm_sum,
        norm_max=jnp.maximum(a.norm_max, b.norm_max),
        layer_norm_histogram=a.layer_norm_histogram + b.layer_norm_histogram,
        example_norm_histogram=a.example_norm_histogram + b.example_norm_histogram,
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
        self._bounds = jnp.asarray(self.bounds, self.compute_dtype)
        self._example_bound = jnp.asarray(policy.example_bound(self.layers), self.compute_dtype)
        self._config = _StepConfig(policy.is_per_layer, policy.rescale_to_unit_norm, policy.non_finite)

    def init(self) -> AccumulatorState:
        """An empty state: zero sums and counts."""
        k = len(self.layers)
        return AccumulatorState(
            sums=tuple(jnp.zeros(l.shape, dt) for l, dt in zip(self.layers, self.sum_dtypes)),
            example_count=jnp.zeros((), jnp.int32),
            clip_counts=jnp.zeros((k,), jnp.int32),
            non_finite_count=jnp.zeros((), jnp.int32),
            norm_sum=jnp.zeros((k,), self.compute_dtype),
            norm_max=jnp.zeros((k,), self.compute_dtype),
            layer_norm_histogram=jnp.zeros((k, NUM_BUCKETS), jnp.int32),
            example_norm_histogram=jnp.zeros((NUM_BUCKETS,), jnp.int32),
        )

    def update(
        self, state: AccumulatorState, batch: Sequence[jax.Array], valid: jax.Array
    ) -> AccumulatorState:
        """Adds one batch: ``batch[k]`` has shape ``(B, *layers[k].shape)``, ``valid`` shape ``(B,)``.

        ``state`` is donated: do not use it afterwards. Rows where ``valid`` is
        False contribute exactly zero and are not counted, whatever they hold.
        """
        return _accumulate_jit(state, tuple(batch), valid, self._bounds, self._example_bound, self._config)

    merge = staticmethod(merge)

    @staticmethod
    def compiled_programs() -> int:
        """How many step programs have been compiled so far in this process."""
        return _accumulate_jit._cache_size()
