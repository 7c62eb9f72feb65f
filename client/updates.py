"""Turning user updates (numpy arrays, JAX arrays, pytrees; one example or a batch) into batches.

No dependency on JAX: nested dicts, lists and tuples are flattened here, in
JAX's order (dict keys sorted), and anything with ``__array__`` is an array.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np


class Layer(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy name: float32, float16, bfloat16, float64


def flatten(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(name, leaf)`` pairs of a nested dict/list/tuple, names joined with '/'.

    >>> [name for name, _ in flatten({"b": [1, 2], "a": {"w": 3}})]
    ['a/w', 'b/0', 'b/1']
    """
    if isinstance(tree, Mapping):
        items = [(str(k), tree[k]) for k in sorted(tree)]
    elif isinstance(tree, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(tree)]
    else:
        return [(prefix, tree)]
    out = []
    for key, value in items:
        out.extend(flatten(value, f"{prefix}/{key}" if prefix else key))
    return out


def layers_like(example: Any, dtype: str | None = None) -> list[Layer]:
    """The layer spec of one example (a pytree of arrays), e.g. for ``create_aggregation``.

    >>> layers_like({"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)})
    [Layer(name='b', shape=(3,), dtype='float32'), Layer(name='w', shape=(2, 3), dtype='float32')]
    """
    out = []
    for name, leaf in flatten(example):
        arr = np.asarray(leaf)
        out.append(Layer(name or "0", tuple(arr.shape), dtype or arr.dtype.name))
    return out


def _leaves(update: Any, layers: Sequence[Layer]) -> list[np.ndarray]:
    """The arrays of one update, in layer order (a dict is matched by layer names)."""
    if isinstance(update, Mapping) and all(layer.name in update for layer in layers):
        leaves = [update[layer.name] for layer in layers]
    else:
        leaves = [leaf for _, leaf in flatten(update)]
    if len(leaves) != len(layers):
        raise ValueError(f"an update has {len(leaves)} arrays, the aggregation has {len(layers)} layers")
    return [np.asarray(leaf) for leaf in leaves]


def as_batch(update: Any, layers: Sequence[Layer]) -> list[np.ndarray]:
    """One update as ``(B, *shape)`` arrays: a single example gets a batch axis of 1."""
    arrays = _leaves(update, layers)
    single = all(a.shape == layer.shape for a, layer in zip(arrays, layers))
    batched = all(a.ndim >= 1 and a.shape[1:] == layer.shape for a, layer in zip(arrays, layers))
    if single:  # one example (its shapes cannot also be a batch's: one less axis)
        arrays = [a[None] for a in arrays]
    elif not batched:
        got = [list(a.shape) for a in arrays]
        want = [list(layer.shape) for layer in layers]
        raise ValueError(f"update shapes {got} are neither one example {want} nor a batch of them")
    rows = {a.shape[0] for a in arrays}
    if len(rows) != 1:
        raise ValueError(f"the layers of a batch have different batch sizes: {sorted(rows)}")
    out = []
    for a, layer in zip(arrays, layers):
        if a.dtype.name != layer.dtype:
            a = a.astype(_numpy_dtype(layer.dtype))
        out.append(np.ascontiguousarray(a))
    return out


def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # only needed for bfloat16 layers

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def iter_updates(updates: Any, layers: Sequence[Layer]) -> Iterator[list[np.ndarray]]:
    """Each update of ``updates`` (one update, a batch, or an iterable of either) as a batch."""
    try:
        yield as_batch(updates, layers)
        return
    except ValueError:
        if isinstance(updates, (Mapping, np.ndarray)) or not isinstance(updates, Iterable):
            raise
    for update in updates:
        yield as_batch(update, layers)


def rebatch(batches: Iterable[list[np.ndarray]], example_bytes: int, target_bytes: int) -> Iterator[list[np.ndarray]]:
    """Packs or splits batches into batches of about ``target_bytes`` (at least one example)."""
    rows_per_batch = max(1, target_bytes // max(1, example_bytes))
    pending: list[list[np.ndarray]] = []
    pending_rows = 0
    for batch in batches:
        start, rows = 0, batch[0].shape[0]
        while start < rows:
            take = min(rows - start, rows_per_batch - pending_rows)
            pending.append([a[start : start + take] for a in batch])
            pending_rows += take
            start += take
            if pending_rows == rows_per_batch:
                yield _concat(pending)
                pending, pending_rows = [], 0
    if pending_rows:
        yield _concat(pending)


def _concat(parts: list[list[np.ndarray]]) -> list[np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    return [np.concatenate(layer) for layer in zip(*parts)]


def example_nbytes(layers: Sequence[Layer]) -> int:
    return sum(math.prod(layer.shape) * _numpy_dtype(layer.dtype).itemsize for layer in layers)
