"""Pytree helpers shared by the reference APIs."""

from __future__ import annotations

import operator
from typing import Any

import jax
import jax.numpy as jnp


def squared_magnitude(leaf: jax.Array) -> jax.Array:
    """``re(x)**2 + im(x)**2`` elementwise, in the leaf's own dtype (ints stay ints)."""
    leaf = jnp.asarray(leaf)
    return jnp.square(leaf.real) + jnp.square(leaf.imag)


def tree_l2_norm(tree: Any) -> jax.Array:
    """Global L2 norm of a pytree: ``sqrt(sum over leaves of sum |x|**2)``.

    Each leaf is reduced in its own dtype, then the per-leaf sums are added in
    flatten order starting from ``0`` (dict keys sorted), as ``optax.tree.norm``
    does. An empty tree has norm 0.

    >>> float(tree_l2_norm({"a": jnp.array([3.0]), "b": jnp.array([[4.0]])}))
    5.0
    """
    sums = jax.tree.map(lambda x: jnp.sum(squared_magnitude(x)), tree)
    return jnp.sqrt(jax.tree.reduce(operator.add, sums, initializer=0))
