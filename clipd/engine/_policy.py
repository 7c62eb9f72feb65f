"""Clipping policies of the streaming accumulator, and the layer spec they apply to."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class LayerSpec(NamedTuple):
    """One layer of a per-example update: its name, per-example shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def size(self) -> int:
        """Number of parameters in one example of this layer."""
        return math.prod(self.shape)


class BoundKind(str, enum.Enum):
    """How the L2 bound is applied to an example."""

    GLOBAL = "global"
    """One bound ``C`` on the norm over all layers (optax global, opacus flat)."""
    PER_LAYER_UNIFORM = "per_layer_uniform"
    """Layer ``k`` of ``K`` clipped to ``C / sqrt(K)`` (optax ``uniform=True``)."""
    PER_LAYER_PROPORTIONAL = "per_layer_proportional"
    """Layer ``k`` clipped to ``C * sqrt(D_k / D)`` (optax ``uniform=False``)."""
    PER_LAYER_EXPLICIT = "per_layer_explicit"
    """Layer ``k`` clipped to its own ``C_k`` (opacus ``ConstantPerLayerClipper``)."""


class NonFinite(str, enum.Enum):
    """What happens to an example whose squared norm is not finite.

    That is an example with a NaN or +-inf entry, or one so large that its
    squared norm overflows.
    """

    ZERO_EXAMPLE = "zero_example"
    """The default: the whole example contributes zero and is counted as non-finite."""
    ZERO_ENTRIES = "zero_entries"
    """Non-finite entries are set to 0, then the example is clipped (jax_privacy ``nan_safe``)."""
    PROPAGATE = "propagate"
    """Nothing special, as optax: a NaN example goes through unclipped and poisons the sum."""


@dataclasses.dataclass(frozen=True)
class ClipPolicy:
    """How each example is clipped before it is added to the sum.

    A bound must be non-negative and not NaN (``inf`` disables clipping); the
    reference APIs keep their libraries' behaviour for the other values, the
    service does not accept them.

    Attributes:
      kind: a :class:`BoundKind`.
      l2_norm_clip: the global bound ``C`` (ignored by ``PER_LAYER_EXPLICIT``).
      layer_clips: the bounds ``C_k`` of ``PER_LAYER_EXPLICIT``, one per layer.
      rescale_to_unit_norm: divide each clipped example by its bound, as
        jax_privacy's ``clip_pytree`` (an example with bound 0 becomes ``x/||x||``).
      non_finite: a :class:`NonFinite`.

    Example:
      >>> policy = ClipPolicy(BoundKind.PER_LAYER_UNIFORM, l2_norm_clip=2.0)
      >>> policy.layer_bounds([LayerSpec("w", (3,)), LayerSpec("b", (1,)),
      ...                      LayerSpec("c", (2, 2)), LayerSpec("d", (5,))])
      (1.0, 1.0, 1.0, 1.0)
    """

    kind: BoundKind = BoundKind.GLOBAL
    l2_norm_clip: float = 1.0
    layer_clips: tuple[float, ...] = ()
    rescale_to_unit_norm: bool = False
    non_finite: NonFinite = NonFinite.ZERO_EXAMPLE

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", BoundKind(self.kind))
        object.__setattr__(self, "non_finite", NonFinite(self.non_finite))
        object.__setattr__(self, "l2_norm_clip", float(self.l2_norm_clip))
        object.__setattr__(self, "layer_clips", tuple(float(c) for c in self.layer_clips))
        explicit = self.kind is BoundKind.PER_LAYER_EXPLICIT
        bounds = self.layer_clips if explicit else (self.l2_norm_clip,)
        if explicit and not bounds:
            raise ValueError("ClipPolicy: per_layer_explicit needs layer_clips, one per layer.")
        if not explicit and self.layer_clips:
            raise ValueError(f"ClipPolicy: layer_clips is only for per_layer_explicit, not {self.kind.value}.")
        for c in bounds:
            if math.isnan(c) or c < 0:
                raise ValueError(f"ClipPolicy: a bound must be >= 0 (inf disables clipping), got {c}.")

    @property
    def is_per_layer(self) -> bool:
        return self.kind is not BoundKind.GLOBAL

    def layer_bounds(self, layers: Sequence[LayerSpec]) -> tuple[float, ...]:
        """The bound of each clip group: ``(C,)`` for GLOBAL, else one per layer.

        Computed in Python floats exactly as optax does, so the bounds agree
        with ``per_example_layer_norm_clip`` to the last bit.
        """
        k = len(layers)
        if self.kind is BoundKind.GLOBAL:
            return (self.l2_norm_clip,)
        if self.kind is BoundKind.PER_LAYER_UNIFORM:
            return tuple(self.l2_norm_clip * (1.0 / k) ** 0.5 for _ in layers)
        if self.kind is BoundKind.PER_LAYER_PROPORTIONAL:
            total = sum(layer.size for layer in layers)
            return tuple(self.l2_norm_clip * (layer.size / total) ** 0.5 for layer in layers)
        if len(self.layer_clips) != k:
            raise ValueError(
                f"ClipPolicy: per_layer_explicit has {len(self.layer_clips)} bounds for {k} layers."
            )
        return self.layer_clips

    def example_bound(self, layers: Sequence[LayerSpec]) -> float:
        """The bound on a whole example's norm: ``C``, or ``sqrt(sum C_k**2)`` for explicit bounds."""
        if self.kind is BoundKind.PER_LAYER_EXPLICIT:
            return float(np.sqrt(np.sum(np.square(self.layer_clips))))
        return self.l2_norm_clip
