"""Batch-level L2 clipping with the semantics of declearn 2.9.1.

These reproduce ``declearn.optimizer.modules.L2Clipping`` and
``L2GlobalClipping`` run on a ``NumpyVector``, with the same numpy operations
in the same order, so results match bit for bit, quirks included:

* the scale is ``min((norm / C) ** -1, 1)``: ``C / norm`` goes through
  declearn's ``Vector.__rtruediv__``, which inverts ``norm / C``. A zero vector
  with ``C = 0`` is therefore all NaN; ``C = 0`` zeroes any other vector;
* the norm is ``np.power(., 0.5)`` of a sum of ``np.sum(np.power(c, 2))``;
* a tie (``norm == C``) has scale 1; a negative ``C`` flips signs; NaN and inf
  are not sanitised (a NaN norm gives NaN, an inf norm a scale of 0);
* dtypes follow numpy: integers come back float64, bfloat16 as numpy's ufuncs
  give it (float32 before ml_dtypes 0.7, bfloat16 from it: as declearn's), a 0-d
  coefficient a numpy scalar, and the global module upcasts every coefficient
  to the widest dtype of the total (float32 mixed with float64 gives float64).
  A numpy scalar ``C`` acts as a Python scalar (numpy hands declearn's
  ``__rtruediv__`` a Python number), so ``np.float64(C)`` does not upcast;
* numpy's RuntimeWarnings (``0/0``, ``inf * 0``) are emitted, as in declearn.

Where the four reference libraries disagree (optax, jax_privacy and opacus
give zeros for a zero vector with ``C = 0``; opacus scales ties by
``C / (C + 1e-6)``; jax_privacy zeroes NaN and inf entries first),
each API in this package follows its own library. See ``shared/SEMANTICS.md``
section 5.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import jax
import numpy as np


def _coefs(gradients: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """Returns the leaves as numpy arrays, in order, and a function to rebuild the tree.

    A flat dict (what a declearn ``Vector`` holds) keeps its insertion order,
    which is the order declearn sums coefficients in; any other pytree is taken
    in ``jax.tree`` flatten order.
    """
    if type(gradients) is dict and jax.tree_util.all_leaves(gradients.values()):
        keys = list(gradients)
        return [np.asarray(gradients[k]) for k in keys], lambda v: dict(zip(keys, v))
    leaves, treedef = jax.tree.flatten(gradients)
    return [np.asarray(x) for x in leaves], lambda v: jax.tree.unflatten(treedef, v)


def _sum_of_squares(coef: Any) -> Any:
    return np.array(np.sum(np.power(coef, 2)))  # NumpyVector: (g ** 2).sum()


def _scale(l2_norm: Any, max_norm: Any) -> Any:
    # (max_norm / l2_norm).minimum(1.0), where float / Vector is (Vector / float) ** -1.
    if isinstance(max_norm, np.generic):
        max_norm = max_norm.item()  # a numpy scalar reaches __rtruediv__ as a Python one
    return np.minimum(np.power(np.divide(l2_norm, max_norm), -1), 1.0)


class _ClippingModule:
    """What declearn's two clipping modules share: a ``max_norm`` and its config."""

    name: ClassVar[str]

    def __init__(self, max_norm: float = 1.0) -> None:
        self.max_norm = max_norm

    def get_config(self) -> dict[str, Any]:
        """Returns ``{"max_norm": max_norm}``, as declearn's ``get_config``."""
        return {"max_norm": self.max_norm}


class L2Clipping(_ClippingModule):
    """Per-parameter L2 clipping, as declearn 2.9.1's ``L2Clipping``.

    Each coefficient ``g_k`` is scaled by its own
    ``min((||g_k|| / max_norm) ** -1, 1)``, in numpy, with no epsilon: a tie
    is left unchanged, a zero coefficient with ``max_norm = 0`` becomes NaN
    (optax, jax_privacy and opacus give zeros), a negative
    ``max_norm`` flips the sign, NaN stays NaN. Each coefficient keeps its own
    dtype (integers become float64; bfloat16 as numpy's ufuncs give it). An empty input gives a
    new, empty structure.

    Args:
      max_norm: the bound ``C``, shared by every coefficient (not validated).

    Example:
      >>> import numpy as np
      >>> clip = L2Clipping(max_norm=1.0)
      >>> clip.run({"w": np.array([3.0, 4.0]), "b": np.array([0.5])})
      {'w': array([0.6, 0.8]), 'b': array([0.5])}
      >>> with np.errstate(invalid="ignore"):  # 0/0, as in declearn
      ...     L2Clipping(0.0).run({"w": np.zeros(2, np.float32)})
      {'w': array([nan, nan], dtype=float32)}
    """

    name: ClassVar[str] = "l2-clipping"


    def run(self, gradients: Any) -> Any:
        """Clips each leaf of a pytree (a dict name -> array) to its own L2 norm bound.

        Args:
          gradients: numpy or JAX arrays, e.g. the coefficients of a declearn Vector.

        Returns:
          The same structure holding numpy arrays (numpy scalars for 0-d leaves).
        """
        coefs, rebuild = _coefs(gradients)
        scales = [_scale(np.power(_sum_of_squares(c), 0.5), self.max_norm) for c in coefs]
        return rebuild([np.multiply(c, s) for c, s in zip(coefs, scales)])


class L2GlobalClipping(_ClippingModule):
    """Global L2 clipping of a whole update, as declearn 2.9.1's ``L2GlobalClipping``.

    Every coefficient is scaled by the same ``min((||g|| / max_norm) ** -1, 1)``
    where ``||g||`` is the L2 norm of all coefficients together: per-coefficient
    sums of squares, added in order starting from ``0``, then ``** 0.5``.
    No epsilon: a tie is left unchanged, a zero update with ``max_norm = 0`` is
    all NaN (optax, jax_privacy and opacus give zeros), a negative
    ``max_norm`` flips every sign, one NaN entry makes everything NaN. The scale
    has the total's dtype, so float32 mixed with float64 gives float64
    everywhere. An empty input is returned as is (the same object).

    Args:
      max_norm: the bound ``C`` on the global norm (not validated).

    Example:
      >>> import numpy as np
      >>> clip = L2GlobalClipping(max_norm=2.5)
      >>> clip.run({"w": np.array([3.0]), "b": np.array([4.0])})
      {'w': array([1.5]), 'b': array([2.])}
      >>> clip.get_config()
      {'max_norm': 2.5}
    """

    name: ClassVar[str] = "l2-global-clipping"


    def run(self, gradients: Any) -> Any:
        """Clips a pytree (a dict name -> array) to a global L2 norm bound.

        Args:
          gradients: numpy or JAX arrays, e.g. the coefficients of a declearn Vector.

        Returns:
          The same structure holding numpy arrays, or ``gradients`` itself if it is empty.
        """
        coefs, rebuild = _coefs(gradients)
        if not coefs:
            return gradients
        total = 0  # declearn: sum(NumpyVector({"norm": s}) for s in sums_of_squares)
        for c in coefs:
            total = np.add(total, _sum_of_squares(c))
        scale = _scale(np.power(total, 0.5), self.max_norm)
        return rebuild([np.multiply(c, scale) for c in coefs])

