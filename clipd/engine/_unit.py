"""The privacy unit: whose influence on a sum one clip bound limits.

Under ``Unit.EXAMPLE`` every example (a row of a batch) is clipped on its own:
DP-SGD's unit, where one example's presence is what a release protects. Under
``Unit.CLIENT`` (federated learning: DP-FedAvg, DP-FTRL) everything one client
sends is one contribution: the rows of its one batch are summed and the sum is
clipped once, as DP-FedAvg clips a client's whole update.

:func:`contribution_rows` is the one place a batch becomes the rows that are clipped: the server's data
and an audit's canaries both go through it.

>>> rows = [np.array([[3.0, 0.0], [0.0, 4.0]], np.float32)]
>>> [a.tolist() for a in contribution_rows(Unit.CLIENT, rows)]
[[[3.0, 4.0]]]
>>> [a.tolist() for a in contribution_rows(Unit.EXAMPLE, rows)]
[[[3.0, 0.0], [0.0, 4.0]]]
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np


class Unit(str, enum.Enum):
    """What one unit of privacy is.

    >>> Unit("client") is Unit.CLIENT, Unit.EXAMPLE.value
    (True, 'example')
    """

    EXAMPLE = "example"  # each row clipped on its own
    CLIENT = "client"  # one contribution per client identity: its rows summed, then clipped once


def contribution_rows(unit: Unit, layers: Sequence[np.ndarray], clients: Sequence[int] | None = None
                      ) -> list[np.ndarray]:
    """The rows of a batch that are clipped, each one contribution: its rows as they are (``EXAMPLE``), or each
    client's rows summed into one (``CLIENT``: :func:`client_contribution`). ``clients``: how many consecutive
    rows each client of the batch sent (None: the whole batch is one client's).

    >>> rows = [np.array([[1.0], [2.0], [4.0]], np.float32)]
    >>> contribution_rows(Unit.CLIENT, rows, clients=[1, 2])[0].tolist()
    [[1.0], [6.0]]
    """
    if Unit(unit) is Unit.EXAMPLE:
        return list(layers)
    return client_contribution(layers, clients)


def client_contribution(layers: Sequence[np.ndarray], clients: Sequence[int] | None = None) -> list[np.ndarray]:
    """Each client's contribution from its rows: each layer's rows summed in float64, rounded once to the
    layer's dtype, one row per client (``(clients, *shape)``). ``clients``: the number of consecutive rows of
    each client (None: all the rows are one client's; a one-row batch is then returned as it is).

    >>> client_contribution([np.ones((3, 2), np.float32)])[0].tolist()
    [[3.0, 3.0]]
    >>> client_contribution([np.arange(6, dtype=np.float32).reshape(3, 2)], clients=[2, 1])[0].tolist()
    [[2.0, 4.0], [4.0, 5.0]]
    """
    if not layers:
        return []
    if clients is None:
        if layers[0].shape[0] == 1:
            return list(layers)
        return [np.sum(layer, axis=0, dtype=np.float64, keepdims=True).astype(layer.dtype) for layer in layers]
    counts = np.asarray(clients, np.int64)
    if counts.size == 0 or np.any(counts < 1) or counts.sum() != layers[0].shape[0]:
        raise ValueError(f"client_contribution: clients of {counts.tolist()} rows for a batch of"
                         f" {layers[0].shape[0]}")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return [np.add.reduceat(np.asarray(layer, np.float64), starts, axis=0).astype(layer.dtype) for layer in layers]
