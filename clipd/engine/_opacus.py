"""Clipping factors with the semantics of opacus 0.15 (``opacus.utils.clipping``).

These reproduce opacus's ``NormClipper``, ``ConstantFlatClipper`` and
``ConstantPerLayerClipper`` (v0.9.0 to v0.15.0, deleted in 1.0) in JAX instead
of torch, quirks included:

* the factor is ``clamp(C / (norm + 1e-6), max=1)``, computed as torch does it:
  ``float / Tensor`` is ``Tensor.reciprocal() * float``, so it is
  ``min(reciprocal(norm + 1e-6) * C, 1)``. For bfloat16 and float16 norms torch
  multiplies by ``C`` rounded to float32 (not to the norms' dtype), and so do we;
* because of the epsilon a tie (``norm == C``) is still scaled, by
  ``C / (C + 1e-6)`` (0.99999905 for ``C = 1`` in float32);
* the clamp is from above only: a negative ``C`` gives negative factors, and
  NaN propagates. ``norm = 0`` with ``C = 0`` gives 0; ``C = inf`` gives 1,
  except for ``norm = inf`` (NaN); ``norm = inf`` gives 0;
* the factors have the norms' dtype (``C`` is a weak Python float);
  ``thresholds`` are float32, as ``torch.tensor([...])``.

The factors are computed eagerly, one operation at a time as in torch; under
``jax.jit`` XLA may keep bfloat16 intermediates in float32.

Where the four reference libraries disagree (optax, jax_privacy and declearn
add no epsilon and leave ties unscaled; declearn returns NaN for a zero vector
with ``C = 0``), each API in this package follows its own library. See
``shared/SEMANTICS.md`` section 5.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _clipping_factor(threshold: float, norms: Any) -> jax.Array:
    """``(threshold / (norms + 1e-6)).clamp(max=1.0)`` with torch's arithmetic."""
    # torch evaluates `float / tensor` as `tensor.reciprocal() * float`.
    inverse = jnp.reciprocal(jnp.asarray(norms) + 1e-6)
    if inverse.dtype in (jnp.bfloat16, jnp.float16):  # torch multiplies by a float32 scalar
        factor = (inverse.astype(jnp.float32) * np.float32(threshold)).astype(inverse.dtype)
    else:
        factor = inverse * threshold
    return jnp.minimum(factor, 1.0)


class NormClipper(abc.ABC):  # noqa: B024 (as opacus: see below)
    """Base clipper, as opacus 0.15's ``NormClipper``.

    Like opacus's, it is an ABC without abstract methods: it can be
    instantiated, and every method and property returns ``None``.

    Example:
      >>> clipper = NormClipper()
      >>> clipper.calc_clipping_factors([]), clipper.thresholds, clipper.is_per_layer
      (None, None, None)
    """

    def calc_clipping_factors(self, norms: Sequence[Any]) -> Any:
        """Returns the clipping factors for per-layer per-example norms (``None`` here)."""
        return None

    @property
    def thresholds(self) -> Any:
        """The clipping thresholds (``None`` here)."""
        return None

    @property
    def is_per_layer(self) -> Any:
        """Whether each layer is clipped separately (``None`` here)."""
        return None


class ConstantFlatClipper(NormClipper):
    """One bound on the global per-example norm, as opacus 0.15's ``ConstantFlatClipper``.

    ``calc_clipping_factors([norms])`` takes a list holding exactly one array
    of per-example global norms and returns ``itertools.cycle([f])``, an
    endless iterator (one factor array per layer), where
    ``f = min(reciprocal(norms + 1e-6) * C, 1)``. Unlike optax, jax_privacy and
    declearn, a tie is scaled by ``C / (C + 1e-6)``, ``C = 0`` gives zeros for
    every norm, and ``C < 0`` gives negative factors. Any other number of norm
    arrays (none included) raises opacus's ``ValueError``.

    Args:
      flat_value: the bound ``C``, stored as ``float(flat_value)``.

    Example:
      >>> import jax.numpy as jnp
      >>> clipper = ConstantFlatClipper(1.0)
      >>> factors = clipper.calc_clipping_factors([jnp.array([0.0, 1.0, 2.0])])
      >>> next(factors)
      Array([1.        , 0.99999905, 0.49999976], dtype=float32)
      >>> clipper.thresholds, clipper.is_per_layer
      (Array([1.], dtype=float32), False)
    """

    def __init__(self, flat_value: float) -> None:
        self.flat_value = float(flat_value)

    def calc_clipping_factors(self, norms: Sequence[Any]) -> Iterator[jax.Array]:
        """Returns an endless iterator repeating the factors for ``norms[0]``.

        Raises:
          ValueError: if ``len(norms) != 1``.
        """
        if len(norms) != 1:
            raise ValueError(
                f"Waring: flat norm selected but received norm for {len(norms)} layers"
            )
        return itertools.cycle([_clipping_factor(self.flat_value, norms[0])])

    @property
    def thresholds(self) -> jax.Array:
        """``[flat_value]`` as a float32 array."""
        return jnp.asarray([self.flat_value], dtype=jnp.float32)

    @property
    def is_per_layer(self) -> bool:
        """False."""
        return False


class ConstantPerLayerClipper(NormClipper):
    """One bound per layer, as opacus 0.15's ``ConstantPerLayerClipper``.

    ``calc_clipping_factors(norms)`` takes one array of per-example norms per
    layer and returns a list with ``min(reciprocal(norms[k] + 1e-6) * C_k, 1)``
    for each layer (ties scaled by ``C_k / (C_k + 1e-6)``, as in
    :class:`ConstantFlatClipper`). It raises ``ValueError`` when the number of
    layers differs from the number of bounds, unless there is one bound: that
    one is then broadcast **and stored**, so ``flat_values`` and
    ``thresholds`` change, and a later call with another number of layers
    raises.

    Args:
      flat_values: the bounds ``C_k``, stored as a list of floats.

    Example:
      >>> import jax.numpy as jnp
      >>> clipper = ConstantPerLayerClipper([2.0])
      >>> clipper.calc_clipping_factors([jnp.array([4.0]), jnp.array([1.0])])
      [Array([0.49999988], dtype=float32), Array([1.], dtype=float32)]
      >>> clipper.flat_values, clipper.is_per_layer
      ([2.0, 2.0], True)
    """

    def __init__(self, flat_values: Sequence[float]) -> None:
        self.flat_values = [float(v) for v in flat_values]

    def calc_clipping_factors(self, norms: Sequence[Any]) -> list[jax.Array]:
        """Returns one factor array per layer, broadcasting (and storing) a single bound.

        Raises:
          ValueError: if ``len(norms)`` differs from the number of bounds (not one).
        """
        if len(norms) != len(self.flat_values) and len(self.flat_values) != 1:
            raise ValueError(
                f"{len(norms)} layers have provided norms but the "
                f"number of clipping thresholds is {len(self.flat_values)}"
            )
        self.flat_values = self.flat_values * (len(norms) if len(self.flat_values) == 1 else 1)
        return [_clipping_factor(t, n) for n, t in zip(norms, self.flat_values)]

    @property
    def thresholds(self) -> jax.Array:
        """``flat_values`` as a float32 array."""
        return jnp.asarray(self.flat_values, dtype=jnp.float32)

    @property
    def is_per_layer(self) -> bool:
        """True."""
        return True
