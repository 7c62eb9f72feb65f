"""A batch on its way into a sum: complete, validated, one ``(rows, *shape)`` array per layer."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from clipd.server.summing.memory import Reservation


class Batch(NamedTuple):
    """A complete, validated batch: one ``(rows, *shape)`` array per layer.

    ``reservation`` holds its bytes in the server's buffer budget until the
    device worker has copied it (or it is dropped): whoever lets go of a batch
    calls :meth:`give_back`. ``weight``: the factor in [0, 1] each of its rows'
    clipped contributions is summed with (a buffered stream's staleness weight;
    1 elsewhere).
    """

    sequence: int
    rows: int
    layers: list[np.ndarray]
    nbytes: int
    reservation: Reservation | None = None
    weight: float = 1.0

    def give_back(self) -> None:
        if self.reservation is not None:
            self.reservation.give_back()
