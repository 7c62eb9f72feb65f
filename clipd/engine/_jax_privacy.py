"""``clip_pytree`` with the semantics of jax_privacy 2.0.0."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp

from ._tree import tree_l2_norm


def clip_pytree(
    pytree: Any,
    clip_norm: Any,
    rescale_to_unit_norm: bool = False,
    nan_safe: bool = True,
    return_zero: bool = False,
) -> tuple[Any, jax.Array]:
    """Clips a pytree to a global L2 norm, as ``jax_privacy.clipping.clip_pytree``.

    ``scale = min(1, C / ||x||)``; with ``rescale_to_unit_norm`` it is
    ``scale / C`` when ``C > 0`` and ``1 / ||x||`` otherwise; a NaN or
    ``+inf`` scale becomes 0. Each leaf is multiplied by the scale cast to its
    own dtype (so an integer leaf gets ``int(scale)``: 0 when clipped).

    Formal guarantees:
      * the output norm is at most ``C`` (at most 1 with
        ``rescale_to_unit_norm``), provided ``nan_safe`` or finite input;
      * the output has the input's structure and leaf dtypes.

    Edge cases, as the library really behaves (the seed's table says "Zero" for
    a dynamic negative bound with rescaling; the library returns ``x / ||x||``):

    ====================== ============ ============================
    case                   rescale      output
    ====================== ============ ============================
    C = 0                  False        zero
    C = 0                  True         ``x / ||x||``
    C = inf                False        unchanged
    C = inf                True         zero
    C < 0, Python/NumPy    either       raises ``ValueError``
    C < 0, array (traced)  False        zero (C is clamped to 0)
    C < 0, array (traced)  True         ``x / ||x||``
    C = NaN                False        zero
    C = NaN                True         ``x / ||x||``
    ||x|| = 0              either       unchanged
    ====================== ============ ============================

    With ``nan_safe`` (default) every NaN and +-inf entry is set to 0 *before*
    the norm, and the returned norm is that of the sanitised tree. Without it a
    NaN makes the norm NaN and the scale 0 (output 0 except NaN at the NaN
    positions); an inf makes the norm inf (output NaN at the inf positions).
    ``return_zero`` zeroes the output but still returns the real norm. Unlike
    optax there is no clip count, a tie is unchanged, and ``0/0`` gives 0.

    Args:
      pytree: any pytree of arrays (a bare array, a list, a dict, ``{}``).
      clip_norm: the bound ``C``; a Python or NumPy scalar is "static" and must
        not be negative, a 0-d array is clamped at 0.
      rescale_to_unit_norm: divide the clipped output by ``C``.
      nan_safe: zero non-finite entries before clipping.
      return_zero: return zeros (a bool or a 0-d bool array).

    Returns:
      ``(clipped_pytree, original_l2_norm)``, the norm always float32.

    Example:
      >>> import jax.numpy as jnp
      >>> clipped, norm = clip_pytree({"w": jnp.array([3.0, 4.0])}, 1.0)
      >>> clipped["w"], norm
      (Array([0.6, 0.8], dtype=float32), Array(5., dtype=float32))
      >>> clip_pytree(jnp.array([3.0, jnp.nan]), 10.0)
      (Array([3., 0.], dtype=float32), Array(3., dtype=float32))
    """
    if isinstance(clip_norm, numbers.Real) and clip_norm < 0:
        raise ValueError(f"clip_pytree: clip_norm must be non-negative, got {clip_norm=}.")
    if nan_safe:
        pytree = jax.tree.map(lambda x: jnp.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), pytree)
    clip_norm = jnp.maximum(clip_norm, 0.0)
    l2_norm = tree_l2_norm(pytree)
    scale = jnp.minimum(1.0, clip_norm / l2_norm)
    if rescale_to_unit_norm:
        scale = jax.lax.select(clip_norm > 0, scale / clip_norm, 1 / l2_norm)
    scale = jnp.nan_to_num(scale, nan=0.0, posinf=0.0)
    clipped = jax.tree.map(lambda x: jnp.astype(scale, x.dtype) * x, pytree)
    clipped = jax.tree.map(lambda x: jax.lax.select(return_zero, jnp.zeros_like(x), x), clipped)
    return clipped, l2_norm.astype(jnp.float32)
