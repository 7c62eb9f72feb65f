"""Turning user updates (numpy arrays, JAX arrays, pytrees; one example or a batch) into batches.

No dependency on JAX: nested dicts, lists and tuples are flattened here, in
JAX's order (dict keys sorted), and anything with ``__array__`` is an array.

Every update is checked against the aggregation's layers before it is
returned; a mismatch raises :class:`~clipd.client.errors.InvalidUpdateError`,
which names the layer and what was expected and what came:

- a mapping (nested dicts flatten to ``"a/b"`` names, as :func:`flatten` does)
  is matched by layer *names* only: a missing layer or an unknown key is an
  error, never matched by position. A list or tuple of arrays (a pytree without
  mappings) is matched by *position*, in layer order, and must have one array
  per layer;
- each array is one example (the layer's shape) or a batch (a leading batch
  axis): all layers of one update alike, with the same, non-zero batch size;
- floating arrays (float16/32/64, and ml_dtypes floats such as bfloat16) are
  cast to the layer's dtype (float64 rounds to float32; values out of a
  narrower type's range become inf). Other dtypes (int, bool, complex, object,
  strings) are refused. Non-finite values are left to the server's policy.
"""

from __future__ import annotations

import difflib
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from clipd import wire

from .errors import InvalidUpdateError


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


# One update ----------------------------------------------------------------------------------


def as_batch(update: Any, layers: Sequence[Layer]) -> list[np.ndarray]:
    """One update as ``(B, *shape)`` arrays of the layers' dtypes, in layer order.

    A single example gets a batch axis of 1. Raises ``InvalidUpdateError`` if
    the update does not fit the layers (see the module's docstring).

    >>> layers = [Layer("w", (2, 3), "float32"), Layer("b", (3,), "float32")]
    >>> [a.shape for a in as_batch({"w": np.ones((2, 3)), "b": np.ones(3)}, layers)]
    [(1, 2, 3), (1, 3)]
    >>> [a.dtype.name for a in as_batch([np.ones((5, 2, 3)), np.ones((5, 3))], layers)]
    ['float32', 'float32']
    >>> as_batch({"w": np.ones((3, 2)), "b": np.ones(3)}, layers)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    clipd.client.errors.InvalidUpdateError: layer 'w': shape (3, 2) is neither one example ...
    """
    arrays = [_array(leaf, layer) for leaf, layer in zip(_leaves(update, layers), layers)]
    batched = [_is_batch(a, layer) for a, layer in zip(arrays, layers)]
    if any(batched) and not all(batched):
        _raise_mixed(arrays, layers, batched)
    if not any(batched):
        arrays = [a[None] for a in arrays]
    _check_rows(arrays, layers)
    return [_cast(a, layer) for a, layer in zip(arrays, layers)]


def _leaves(update: Any, layers: Sequence[Layer]) -> list[Any]:
    """The leaves of one update in layer order: a mapping by names, a list/tuple by position."""
    if isinstance(update, Mapping) or _holds_mapping(update):
        return _leaves_by_name(update, layers)
    if isinstance(update, (list, tuple)):
        return _leaves_by_position(update, layers)
    if len(layers) == 1:
        return [update]
    names = [layer.name for layer in layers]
    raise InvalidUpdateError(
        f"an update is one array of shape {np.shape(update)}, but the aggregation has"
        f" {len(layers)} layers {_quoted(names)}: give a dict {{name: array}} or a list in"
        " layer order",
        expected=names, got=np.shape(update),
    )


def _holds_mapping(tree: Any) -> bool:
    """Whether a list/tuple pytree has a mapping anywhere in it (then its leaves are named)."""
    if isinstance(tree, Mapping):
        return True
    return isinstance(tree, (list, tuple)) and any(_holds_mapping(x) for x in tree)


def _leaves_by_name(update: Any, layers: Sequence[Layer]) -> list[Any]:
    """The leaves named like the layers, or an error naming the missing layers and unknown keys.

    >>> layers = [Layer("w", (), "float32"), Layer("b", (), "float32")]
    >>> _leaves_by_name({"W": 1, "b": 2}, layers)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    clipd.client.errors.InvalidUpdateError: ... unknown key 'W' (did you mean 'w'?)
    """
    leaves: dict[str, Any] = {}
    for name, leaf in flatten(update):
        if name in leaves:
            raise InvalidUpdateError(f"the update names {name!r} twice", layer=name)
        leaves[name] = leaf
    names = [layer.name for layer in layers]
    missing = [name for name in names if name not in leaves]
    unknown = [key for key in leaves if key not in set(names)]
    if missing or unknown:
        problems = []
        if missing:
            problems.append(f"missing layer{'s' if len(missing) > 1 else ''} {_quoted(missing)}")
        problems += [f"unknown key {key!r}{_suggestion(key, missing)}" for key in unknown]
        raise InvalidUpdateError(
            f"the update's names do not match the layers {_quoted(names)}: {'; '.join(problems)}",
            layer=missing[0] if len(missing) == 1 else "", expected=names, got=list(leaves),
        )
    return [leaves[name] for name in names]


def _suggestion(key: str, candidates: Sequence[str]) -> str:
    """`` (did you mean 'w'?)`` when one candidate is close to ``key`` (ignoring case), else ''.

    >>> _suggestion("W", ["w", "b"]), _suggestion("kernel", ["w", "b"])
    (" (did you mean 'w'?)", '')
    """
    by_lower: dict[str, str] = {}
    for name in candidates:
        by_lower.setdefault(name.lower(), name)
    close = difflib.get_close_matches(key.lower(), list(by_lower), n=1)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""


def _leaves_by_position(update: Sequence[Any], layers: Sequence[Layer]) -> list[Any]:
    leaves = [leaf for _, leaf in flatten(update)]
    if len(leaves) != len(layers):
        raise InvalidUpdateError(
            f"an update given as a list/tuple has {len(leaves)} arrays, matched by position to"
            f" {len(layers)} layers {_quoted([layer.name for layer in layers])}",
            expected=len(layers), got=len(leaves),
        )
    return leaves


def _array(leaf: Any, layer: Layer) -> np.ndarray:
    """``leaf`` as a numpy array of a floating dtype (a JAX array is copied to the host here)."""
    try:
        arr = np.asarray(_host_tensor(leaf))
    except (TypeError, ValueError) as e:
        raise InvalidUpdateError(f"layer {layer.name!r}: not an array ({e})", layer=layer.name,
                                 expected=layer.dtype, got=type(leaf).__name__) from None
    if not _is_floating(arr.dtype):
        raise InvalidUpdateError(
            f"layer {layer.name!r}: dtype {arr.dtype} is not a floating type"
            f" (the layer is {layer.dtype})",
            layer=layer.name, expected=layer.dtype, got=str(arr.dtype),
        )
    return arr


def _host_tensor(leaf: Any) -> Any:
    """A PyTorch tensor as a numpy array: detached from autograd, on the CPU. A CPU tensor is viewed,
    not copied (torch's ``numpy()`` shares its memory); anything else is returned as it is. No import
    of torch: a tensor is whatever has ``detach``, ``cpu`` and ``numpy``."""
    if all(hasattr(leaf, name) for name in ("detach", "cpu", "numpy")):
        return leaf.detach().cpu().numpy()
    return leaf


def _is_floating(dtype: np.dtype) -> bool:
    """float16/32/64 and the like, and ml_dtypes' floats (bfloat16, float8_*: numpy kind 'V').

    >>> [_is_floating(np.dtype(t)) for t in ("float64", "int32", "bool", "complex64", "U3", "O")]
    [True, False, False, False, False, False]
    """
    return dtype.kind == "f" or (dtype.type.__module__ == "ml_dtypes" and "float" in dtype.name)


def _is_batch(arr: np.ndarray, layer: Layer) -> bool:
    """False for one example (the layer's shape), True for a batch of them, else an error."""
    if arr.shape == layer.shape:
        return False
    if arr.shape[1:] == layer.shape:
        return True
    raise InvalidUpdateError(
        f"layer {layer.name!r}: shape {arr.shape} is neither one example {layer.shape}"
        f" nor a batch {_batch_shape(layer.shape)}{_shape_hint(arr.shape, layer.shape)}",
        layer=layer.name, expected=layer.shape, got=arr.shape,
    )


def _batch_shape(shape: tuple[int, ...]) -> str:
    """
    >>> _batch_shape((6, 4)), _batch_shape(())
    ('(B, 6, 4)', '(B,)')
    """
    return f"(B, {', '.join(map(str, shape))})" if shape else "(B,)"


def _shape_hint(got: tuple[int, ...], want: tuple[int, ...]) -> str:
    """What a wrong shape may be: a batch of wrongly shaped examples, or a transposed layer."""
    if len(got) == len(want) + 1:
        transposed = " (transposed?)" if sorted(got[1:]) == sorted(want) else ""
        return f"; as a batch of {got[0]}, its examples have shape {got[1:]}{transposed}"
    return " (transposed?)" if sorted(got) == sorted(want) else ""


def _raise_mixed(arrays: Sequence[np.ndarray], layers: Sequence[Layer],
                 batched: Sequence[bool]) -> None:
    kinds = [f"{layer.name!r} {'a batch' if b else 'one example'} {a.shape}"
             for a, layer, b in zip(arrays, layers, batched)]
    raise InvalidUpdateError(
        "an update mixes single examples and batches (all its layers must be one or the other): "
        + ", ".join(kinds),
        expected={layer.name: layer.shape for layer in layers},
        got={layer.name: a.shape for a, layer in zip(arrays, layers)},
    )


def _check_rows(batch: Sequence[np.ndarray], layers: Sequence[Layer]) -> None:
    """All layers of a batch have the same, non-zero, number of examples."""
    rows = {layer.name: a.shape[0] for a, layer in zip(batch, layers)}
    if len(set(rows.values())) > 1:
        sizes = ", ".join(f"{name!r} {n}" for name, n in rows.items())
        raise InvalidUpdateError(f"the layers of a batch have different batch sizes: {sizes}",
                                 got=rows)
    if 0 in rows.values():
        shapes = ", ".join(f"{layer.name!r} {a.shape}" for a, layer in zip(batch, layers))
        raise InvalidUpdateError(f"an update is a batch of 0 examples: {shapes}",
                                 expected="at least 1", got=0)


def _cast(arr: np.ndarray, layer: Layer) -> np.ndarray:
    """``arr`` in the layer's dtype (little-endian, as the wire sends it), contiguous: ``arr`` itself (no
    copy, whatever its size) when it is so already; else one copy, converted (another floating dtype, a
    big-endian one, a strided or Fortran-ordered view)."""
    dtype = wire.numpy_dtype(layer.dtype)
    if arr.dtype != dtype:
        arr = arr.astype(dtype)
    return np.ascontiguousarray(arr)


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(repr(name) for name in names)


# A stream of updates ---------------------------------------------------------------------------


def iter_updates(updates: Any, layers: Sequence[Layer]) -> Iterator[list[np.ndarray]]:
    """Each update of ``updates`` (one update, a batch, or an iterable of either) as a batch.

    Whether ``updates`` is one update or an iterable of them is decided once, up
    front, from its type and structure (see :func:`_is_one_update`); then each
    update is checked when it is reached. The first bad one raises
    ``InvalidUpdateError`` ("update #3: ..." in an iterable), after the good ones
    before it have been yielded. Lazy: one update is read at a time.

    >>> layers = [Layer("w", (2,), "float32")]
    >>> [b[0].shape for b in iter_updates(iter([np.ones(2), np.ones((3, 2))]), layers)]
    [(1, 2), (3, 2)]
    >>> list(iter_updates([np.ones(2), np.ones(3)], layers))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    clipd.client.errors.InvalidUpdateError: update #1: layer 'w': shape (3,) is neither ...
    """
    if _is_one_update(updates, layers):
        yield as_batch(updates, layers)
        return
    for index, update in enumerate(updates):
        try:
            batch = as_batch(update, layers)
        except InvalidUpdateError as e:
            raise InvalidUpdateError(f"update #{index}: {e.details}", layer=e.layer,
                                     expected=e.expected, got=e.got) from None
        yield batch


def _is_one_update(updates: Any, layers: Sequence[Layer]) -> bool:
    """Whether ``updates`` is one update (else an iterable of them), from its type and structure.

    One update: a mapping, an array (anything with ``__array__``, or not
    iterable), or a list/tuple that has the layers' own structure (its
    flattened names are the layer names) or, with several layers, holds an
    array at its top (an iterable of updates would hold containers). An empty
    list/tuple, a list/tuple of arrays for a one-layer aggregation, and any
    other iterable (a generator, an iterator) are iterables of updates.

    >>> layers = [Layer("w", (2,), "float32"), Layer("b", (2,), "float32")]
    >>> w, b = np.ones(2), np.ones(2)
    >>> _is_one_update([w, b], layers), _is_one_update([[w, b]], layers), _is_one_update([], layers)
    (True, False, False)
    """
    if isinstance(updates, Mapping):
        return True
    if isinstance(updates, (list, tuple)):
        if not updates:
            return False
        names = [layer.name for layer in layers]
        if len(updates) <= len(layers) and [name for name, _ in flatten(updates)] == names:
            return True  # the layers' own structure
        return len(layers) > 1 and any(not isinstance(x, (Mapping, list, tuple)) for x in updates)
    if hasattr(updates, "__array__") or isinstance(updates, (str, bytes)):
        return True
    return not isinstance(updates, Iterable)


# Packing batches into messages -----------------------------------------------------------------


def rebatch(batches: Iterable[list[np.ndarray]], example_bytes: int, target_bytes: int) -> Iterator[list[np.ndarray]]:
    """Packs or splits batches into batches of about ``target_bytes`` (at least one example).

    If ``batches`` raises (a bad update), the rows before it are yielded first,
    then the error is raised: the good updates before a bad one are sent.

    No copy of large examples: a batch's rows are views of the arrays given; only rows of different
    updates gathered into one batch (each of them smaller than ``target_bytes``) are concatenated.
    """
    rows_per_batch = max(1, target_bytes // max(1, example_bytes))
    pending: list[list[np.ndarray]] = []
    pending_rows = 0
    source, failure = iter(batches), None
    while True:
        try:
            batch = next(source)
        except StopIteration:
            break
        except Exception as error:  # raised again below, after the good rows
            failure = error
            break
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
    if failure is not None:
        raise failure


def sum_rows(batches: Iterable[list[np.ndarray]], layers: Sequence[Layer]) -> list[np.ndarray] | None:
    """One client's contribution under unit ``client``: every row of ``batches`` summed per layer in float64,
    rounded once to the layer's dtype, as a batch of one row (the server would sum them so; summing here sends
    one row instead of all). A lone one-row batch is returned as it is (no copy); None if there is no row.

    >>> layers = [Layer("w", (2,), "float32")]
    >>> sum_rows(iter([[np.ones((2, 2))], [np.full((1, 2), 0.5)]]), layers)[0].tolist()
    [[2.5, 2.5]]
    """
    source = iter(batches)
    first = next(source, None)
    if first is None:
        return None
    second = next(source, None)
    if second is None and first[0].shape[0] == 1:
        return first
    totals: list[np.ndarray] = [np.asarray(np.sum(rows, axis=0, dtype=np.float64, keepdims=True)) for rows in first]
    for batch in itertools.chain([second] if second is not None else [], source):
        for total, rows in zip(totals, batch):
            total += np.sum(rows, axis=0, dtype=np.float64)
    return [total.astype(wire.numpy_dtype(layer.dtype)) for total, layer in zip(totals, layers)]


def _concat(parts: list[list[np.ndarray]]) -> list[np.ndarray]:
    """One batch of the parts (about ``target_bytes`` in all): the part itself, not a copy, if it is alone."""
    if len(parts) == 1:
        return parts[0]
    return [np.concatenate(layer) for layer in zip(*parts)]


def example_nbytes(layers: Sequence[Layer], wire_dtype: str | None = None) -> int:
    """The bytes of one example on the wire (a 16-bit ``wire_dtype`` halves its float32 layers').

    >>> example_nbytes([Layer("w", (2, 3), "float32"), Layer("b", (3,), "float64")], "bfloat16")
    36
    """
    return sum(math.prod(layer.shape) * (2 if wire_dtype is not None and layer.dtype == "float32"
                                         else wire.numpy_dtype(layer.dtype).itemsize) for layer in layers)
