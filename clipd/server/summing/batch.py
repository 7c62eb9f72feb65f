"""A batch on its way into a sum: complete, validated, one ``(rows, *shape)`` array per layer."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from clipd.server.summing.memory import Reservation


class Batch(NamedTuple):
    """A complete, validated batch: one ``(rows, *shape)`` array per layer.

    ``reservation`` holds its bytes in the server's buffer budget until the
    device worker has copied it (or it is dropped): whoever lets go of a batch
    calls :meth:`give_back`.
    """

    sequence: int
    rows: int
    layers: list[np.ndarray]
    nbytes: int
    reservation: Reservation | None = None

    def give_back(self) -> None:
        if self.reservation is not None:
            self.reservation.give_back()
