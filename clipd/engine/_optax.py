"""Per-example clipping with the semantics of optax >= 0.2.4.

These reproduce ``optax.per_example_global_norm_clip`` and
``optax.per_example_layer_norm_clip`` (optax 0.2.8), quirks included:

* the multiplier is ``nan_to_num(min(C / norm, 1), nan=1)``, with no epsilon;
* an example is counted as clipped when its multiplier is ``< 1``, so a tie
  (``norm == C``) is neither scaled nor counted;
* ``0/0`` and ``inf/inf`` give a multiplier of 1 (not counted), a NaN entry lets
  the example through unclipped and uncounted, a NaN bound disables clipping;
* a negative bound is not validated: it flips the sign of every example.

Where the four reference libraries disagree (jax_privacy zeroes non-finite
entries and returns zero for ``0/0``; declearn returns NaN for a zero vector
with ``C = 0``; opacus scales ties by ``C / (C + 1e-6)``), each API in this
package follows its own library. See ``shared/SEMANTICS.md`` section 5.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._tree import tree_l2_norm


def _check_batch_dim(grads: Any, name: str) -> None:
    leaves = jax.tree.leaves(grads)
    batch_size = leaves[0].shape[0]  # IndexError on an empty tree, as in optax.
    if not all(g.ndim >= 1 and g.shape[0] == batch_size for g in leaves):
        raise ValueError(
            f"{name} expects every array in `grads` to have the same batch "
            f"dimension on axis 0; got shapes {jax.tree.map(jnp.shape, grads)}."
        )


def _clip_and_sum(grads: Any, l2_norm_clip: Any) -> tuple[Any, jax.Array]:
    norms = jax.vmap(tree_l2_norm)(grads)
    multipliers = jnp.nan_to_num(jnp.minimum(l2_norm_clip / norms, 1.0), nan=1.0)
    num_clipped = jnp.sum(multipliers < 1.0)
    clipped_sum = jax.tree.map(lambda g: jnp.tensordot(multipliers, g, axes=1), grads)
    return clipped_sum, num_clipped


def per_example_global_norm_clip(grads: Any, l2_norm_clip: Any) -> tuple[Any, jax.Array]:
    """Clips each example to a global L2 norm and sums the clipped examples.

    For example ``b`` with global norm ``n_b`` (over all leaves),
    ``m_b = nan_to_num(min(C / n_b, 1), nan=1)`` and the result is
    ``sum_b m_b * g_b`` per leaf, with the count of examples where ``m_b < 1``.

    Args:
      grads: pytree of arrays, each with the batch on axis 0.
      l2_norm_clip: the bound ``C`` (a scalar, or an array of shape ``(B,)``).

    Returns:
      ``(clipped_sum, num_clipped)``: a pytree like ``grads`` without the
      batch axis, and a 0-d integer count.

    Example:
      >>> import jax.numpy as jnp
      >>> grads = [jnp.array([[0, 0, 0], [0, 3, 4], [4, 0, 3], [3, 4, 0]])]
      >>> per_example_global_norm_clip(grads, jnp.inf)
      ([Array([7., 7., 7.], dtype=float32)], Array(0, dtype=int32))
      >>> per_example_global_norm_clip(grads, 0.0)
      ([Array([0., 0., 0.], dtype=float32)], Array(3, dtype=int32))
      >>> per_example_global_norm_clip(grads, 1.25)
      ([Array([1.75, 1.75, 1.75], dtype=float32)], Array(3, dtype=int32))
    """
    _check_batch_dim(grads, "per_example_global_norm_clip")
    return _clip_and_sum(grads, l2_norm_clip)


def per_example_layer_norm_clip(
    grads: Any, global_l2_norm_clip: Any, uniform: bool = True
) -> tuple[Any, Any]:
    """Clips each layer of each example to its own bound and sums them.

    With ``K`` layers and global bound ``C``, layer ``k`` is clipped to
    ``C_k = C / sqrt(K)`` when ``uniform``, else ``C_k = C * sqrt(D_k / D)``
    where ``D_k`` is the layer's per-example size and ``D = sum D_k``. Each
    layer is then clipped exactly as :func:`per_example_global_norm_clip`.

    Args:
      grads: pytree of arrays (one per layer), each with the batch on axis 0.
      global_l2_norm_clip: the overall bound ``C``.
      uniform: split ``C`` evenly across layers, or by layer size.

    Returns:
      ``(clipped_sums, num_clipped)``: two pytrees shaped like ``grads``, the
      second holding one 0-d count per layer.

    Example:
      >>> import jax.numpy as jnp
      >>> grads = [jnp.array([[0, 0, 0], [0, 3, 4], [4, 0, 3], [3, 4, 0]])]
      >>> per_example_layer_norm_clip(grads, jnp.inf)
      ([Array([7., 7., 7.], dtype=float32)], [Array(0, dtype=int32)])
      >>> per_example_layer_norm_clip(grads, 0.0)
      ([Array([0., 0., 0.], dtype=float32)], [Array(3, dtype=int32)])
      >>> per_example_layer_norm_clip(grads, 1.25)
      ([Array([1.75, 1.75, 1.75], dtype=float32)], [Array(3, dtype=int32)])
    """
    _check_batch_dim(grads, "per_example_layer_norm_clip")
    if uniform:
        num_layers = len(jax.tree.leaves(grads))
        layer_clips = jax.tree.map(lambda _: global_l2_norm_clip * (1.0 / num_layers) ** 0.5, grads)
    else:
        total = sum(g[0].size for g in jax.tree.leaves(grads))
        layer_clips = jax.tree.map(lambda g: global_l2_norm_clip * (g[0].size / total) ** 0.5, grads)
    per_layer = jax.tree.map(lambda g, c: _clip_and_sum(g, c), grads, layer_clips)
    return jax.tree.transpose(
        outer_treedef=jax.tree.structure(grads),
        inner_treedef=jax.tree.structure((0, 0)),
        pytree_to_transpose=per_layer,
    )
