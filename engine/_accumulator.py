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
    """Running sums and statistics of one aggregation (a pytree). K = number of layers.

    The small statistics travel packed in two arrays (fewer buffers per step
    and per host read); the properties below name their parts.
    """

    sums: tuple[jax.Array, ...]  # per layer: its shape, float32 (float64 for float64 input)
    counts: jax.Array  # int32: [examples, non-finite, clip counts (K), layer hist (K*NB), example hist (NB)]
    norms: jax.Array  # float32: [sum of layer norms (K), largest layer norm (K)]

    @property
    def num_layers(self) -> int:
        return (self.counts.shape[0] - 2 - NUM_BUCKETS) // (1 + NUM_BUCKETS)

    @property
    def example_count(self):
        """Valid examples seen, non-finite ones included."""
        return self.counts[0]

    @property
    def non_finite_count(self):
        """Examples whose squared norm was not finite (NaN or inf entries, or overflow)."""
        return self.counts[1]

    @property
    def clip_counts(self):
        """``(K,)``: examples whose layer k was scaled down (GLOBAL: the same count K times)."""
        return self.counts[2 : 2 + self.num_layers]

    @property
    def layer_norm_histogram(self):
        """``(K, NUM_BUCKETS)``: layer norm / layer bound, bucketed by ``RATIO_BUCKETS``."""
        k = self.num_layers
        return self.counts[2 + k : 2 + k + k * NUM_BUCKETS].reshape(k, NUM_BUCKETS)

    @property
    def example_norm_histogram(self):
        """``(NUM_BUCKETS,)``: whole-example norm / example bound."""
        return self.counts[self.counts.shape[0] - NUM_BUCKETS :]

    @property
    def norm_sum(self):
        """``(K,)``: sum of the layer norms of the examples in the statistics (for the mean)."""
        return self.norms[: self.norms.shape[0] // 2]

    @property
    def norm_max(self):
        """``(K,)``: largest layer norm seen."""
        return self.norms[self.norms.shape[0] // 2 :]


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


def _histogram(ratios: jax.Array, rows: jax.Array) -> jax.Array:
    """Counts of ``ratios[..., b]`` per bucket over the rows where ``rows`` is True."""
    edges = jnp.asarray(RATIO_BUCKETS, ratios.dtype)
    index = jnp.sum(ratios[..., None] > edges, axis=-1)  # edges[i-1] < ratio <= edges[i]
    in_bucket = (index[..., None] == jnp.arange(NUM_BUCKETS)) & rows[..., None]
    return jnp.sum(in_bucket, axis=-2, dtype=jnp.int32)


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
    compute_dtype = state.norms.dtype
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

    # The usual case, computed unconditionally (inside a lax.cond branch XLA's CPU backend runs the
    # dots about 2x slower): a 0 multiplier is enough when no masked or dropped row is non-finite.
    fast = _clip_and_sum(flat, squared, valid, bounds, config, sum_dtypes)

    def cleaned(flat):  # rare: select the entries to keep first (one more pass)
        flat = tuple(jnp.where(keep(x), x, jnp.zeros((), x.dtype)) for x in flat)
        return _clip_and_sum(
            flat, _row_squared_norms(flat, compute_dtype), valid, bounds, config, sum_dtypes
        )

    contributions, norms = jax.lax.cond(jnp.any(needs_cleaning), cleaned, lambda _: fast, flat)

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
    # One histogram over K + 1 rows: each layer against its bound, then the whole example.
    ratios = jnp.concatenate([_ratio(layer_norms, layer_bounds), _ratio(example_norms, example_bound)[None]])
    rows = jnp.concatenate([in_stats, (counted & jnp.isfinite(example_norms))[None]])
    counts = jnp.concatenate([
        jnp.stack([jnp.sum(valid, dtype=jnp.int32), jnp.sum(valid & ~finite_rows, dtype=jnp.int32)]),
        clip_counts,
        _histogram(ratios, rows).reshape(-1),
    ])
    stat_norms = jnp.where(in_stats, layer_norms, 0.0)
    k = len(flat)
    return AccumulatorState(
        sums=tuple(s + c.reshape(s.shape) for s, c in zip(state.sums, contributions)),
        counts=state.counts + counts,
        norms=jnp.concatenate([
            state.norms[:k] + jnp.sum(stat_norms, axis=1),
            jnp.maximum(state.norms[k:], jnp.max(stat_norms, axis=1)),
        ]),
    )


_accumulate_jit = jax.jit(_accumulate, static_argnames=("config",), donate_argnums=(0,))


def merge(a: AccumulatorState, b: AccumulatorState) -> AccumulatorState:
    """Combines two partial states of the same aggregation (sums and counts add up).

    Partial sums from several workers or replicas merge into the state that one
    worker would have reached on all their batches (up to float rounding).
    """
    k = len(a.sums)
    return AccumulatorState(
        sums=tuple(x + y for x, y in zip(a.sums, b.sums)),
        counts=a.counts + b.counts,
        norms=jnp.concatenate([a.norms[:k] + b.norms[:k], jnp.maximum(a.norms[k:], b.norms[k:])]),
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
            counts=jnp.zeros((2 + k + (k + 1) * NUM_BUCKETS,), jnp.int32),
            norms=jnp.zeros((2 * k,), self.compute_dtype),
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
