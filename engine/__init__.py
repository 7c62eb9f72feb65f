"""clipd.engine: the clipping math, in pure JAX (no gRPC, no web, no I/O)."""

from ._accumulator import (
    NUM_BUCKETS,
    RATIO_BUCKETS,
    AccumulatorState,
    ClipAccumulator,
    merge,
    multiplier,
)
from ._jax_privacy import clip_pytree
from ._optax import per_example_global_norm_clip, per_example_layer_norm_clip
from ._policy import BoundKind, ClipPolicy, LayerSpec, NonFinite

__all__ = [
    "AccumulatorState",
    "BoundKind",
    "ClipAccumulator",
    "ClipPolicy",
    "LayerSpec",
    "NUM_BUCKETS",
    "NonFinite",
    "RATIO_BUCKETS",
    "clip_pytree",
    "merge",
    "multiplier",
    "per_example_global_norm_clip",
    "per_example_layer_norm_clip",
]
