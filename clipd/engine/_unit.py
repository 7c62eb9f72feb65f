"""The privacy unit: whose influence on a sum one clip bound limits.

Under ``Unit.EXAMPLE`` every example (a row of a batch) is clipped on its own:
DP-SGD's unit, where one example's presence is what a release protects. Under
``Unit.CLIENT`` (federated learning: DP-FedAvg, DP-FTRL) everything one client
sends is one contribution: the rows of its one batch are summed and the sum is
clipped once, as DP-FedAvg clips a client's whole update.

>>> rows = [np.array([[3.0, 0.0], [0.0, 4.0]], np.float32)]
>>> [a.tolist() for a in client_contribution(rows)]
[[[3.0, 4.0]]]
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


def client_contribution(layers: Sequence[np.ndarray]) -> list[np.ndarray]:
    """One client's contribution from its batch: each layer's rows summed in float64, rounded once to the
    layer's dtype, as a batch of one row (``(1, *shape)``). A one-row batch is returned as it is.

    >>> client_contribution([np.ones((3, 2), np.float32)])[0].tolist()
    [[3.0, 3.0]]
    """
    if not layers or layers[0].shape[0] == 1:
        return list(layers)
    return [np.sum(layer, axis=0, dtype=np.float64, keepdims=True).astype(layer.dtype) for layer in layers]
