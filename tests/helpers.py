"""Shared test helpers: random per-example batches, tolerant comparisons, and waiting for a condition."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

import jax.numpy as jnp
import numpy as np

T = TypeVar("T")

# Relative tolerance per dtype when two implementations may round differently.
RTOL = {"float32": 1e-5, "float64": 1e-12, "float16": 2e-3, "bfloat16": 2e-2}


def layer_shapes(num_layers: int, rng: np.random.Generator) -> list[tuple[int, ...]]:
    """A mix of 1-d, 2-d and 3-d layer shapes, small enough for fast tests."""
    choices = [(5,), (3, 4), (2, 3, 2), (7,), (1,), (4, 1)]
    return [choices[int(i)] for i in rng.integers(0, len(choices), size=num_layers)]


def random_batch(
    rng: np.random.Generator,
    batch: int,
    shapes: list[tuple[int, ...]],
    dtype: str = "float32",
    spread: float = 3.0,
) -> list[np.ndarray]:
    """Per-example layers whose example norms spread over orders of magnitude."""
    scales = np.exp(rng.uniform(-spread, spread, size=(batch,)))
    out = []
    for shape in shapes:
        x = rng.standard_normal((batch, *shape)) * scales.reshape((batch,) + (1,) * len(shape))
        out.append(np.array(jnp.asarray(x, dtype=dtype)))  # a writable copy
    return out


def assert_close(actual, expected, dtype: str = "float32", rtol: float | None = None) -> None:
    """Same dtype and shape; values within ``rtol`` relative to the largest entry."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    rtol = RTOL[dtype] if rtol is None else rtol
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    finite = np.isfinite(e)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(e))
    np.testing.assert_array_equal(a[np.isinf(e)], e[np.isinf(e)])
    scale = np.max(np.abs(e[finite]), initial=0.0)
    np.testing.assert_allclose(a[finite], e[finite], rtol=rtol, atol=rtol * scale)


def global_norms(batch: list[np.ndarray]) -> np.ndarray:
    """Per-example global L2 norms in float64 (an independent reference)."""
    b = batch[0].shape[0]
    sq = sum(np.sum(np.square(np.asarray(x).astype(np.float64).reshape(b, -1)), axis=1) for x in batch)
    return np.sqrt(sq)


def is_tie_free(norms: np.ndarray, bound: float, rel: float = 1e-4) -> bool:
    """True when no norm is within ``rel`` of the bound (rounding could flip the count)."""
    if not math.isfinite(bound) or bound == 0:
        return True
    return bool(np.all(np.abs(norms - bound) > rel * bound))


def wait_until(condition: Callable[[], T], timeout: float, what: str | Callable[[], str], step: float = 0.01) -> T:
    """Polls ``condition()`` every ``step`` s until it is truthy, and returns that value.

    Fails the test with ``AssertionError("<what>: not within <timeout> s")`` when it is still falsy at a poll
    made after ``timeout`` s. ``what`` says what was awaited: a string, or a callable giving one, called only
    then (to show the state that was reached). An exception raised by ``condition`` propagates at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what() if callable(what) else what}: not within {timeout} s")
        time.sleep(step)
