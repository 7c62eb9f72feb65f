"""Buffered asynchronous aggregation (FedBuff, Nguyen et al., AISTATS 2022): staleness and what a client costs.

Clients train all the time; the server releases a buffer once it holds ``K`` contributions, as model version
``V``. A contribution trained from version ``v`` that lands in the buffer of version ``V`` is

    tau = V - 1 - v

releases stale (0: trained from the newest model), and its clipped vector is weighted by ``w(tau) <= 1``:
FedBuff's polynomial ``(1 + tau)^-a`` by default (:func:`staleness_weight`). A weight of at most 1 applied
after the clip keeps each contribution within its bound, so the release's sensitivity is the bound's.

Asynchronous clients are not sampled: privacy comes from how often each client may take part, at most ``k``
contributions and at least ``b`` releases between two (``engine._privacy.Participation``). With independent
noise each release is a Gaussian mechanism of multiplier ``z`` on the client's contribution, and a client meets
at most ``k`` of them (``participation_event``: their composition, for dp_accounting). The neighbouring relation
is zero-out (a client's contributions replaced by zeros, the arrivals unchanged), as DP-FTRL's analysis uses:
a buffer that closes after ``K`` arrivals has boundaries that move when a client is added or removed, and
zero-out keeps them where they are; one zero-out moves a release's sum by at most the bound, as one addition
or removal does, so the Gaussian's accounting is the same.

>>> [round(staleness_weight(tau, 0.5), 4) for tau in range(4)]
[1.0, 0.7071, 0.5774, 0.5]
>>> staleness(released=7, trained_from=5)
1
"""

from __future__ import annotations

import math

DEFAULT_EXPONENT = 0.5  # FedBuff's a (its experiments' choice)


def staleness(released: int, trained_from: int) -> int:
    """``tau = V - 1 - v``: how many versions were released between the model a contribution was trained from
    (``trained_from``, v) and the one its buffer becomes (``released``, V). ValueError for a version that is not
    out yet (``v >= V``)."""
    tau = released - 1 - trained_from
    if tau < 0:
        raise ValueError(f"a contribution trained from version {trained_from} can't land in version {released}")
    return tau


def staleness_weight(tau: int, exponent: float = DEFAULT_EXPONENT) -> float:
    """FedBuff's ``(1 + tau)^-a``: 1 for a fresh contribution, less for a stale one (``a >= 0``; 0: every weight 1).

    >>> staleness_weight(3, 0.0), staleness_weight(3, 1.0)
    (1.0, 0.25)
    """
    if tau < 0:
        raise ValueError(f"staleness is >= 0, got {tau}")
    if not (exponent >= 0 and math.isfinite(exponent)):
        raise ValueError(f"the staleness exponent is finite and >= 0, got {exponent}")
    return float((1.0 + tau) ** -exponent)


TRAINED_FROM = "v"  # a stream contribution's writer id: "v<the version it trained from>" (kept in the checkpoints)


def trained_from_writer(version: int) -> str:
    """The writer id a stream contribution is summed under: the version it was trained from, so that its buffer's
    checkpoints keep it (and its staleness is known after a restart).

    >>> trained_from_writer(12), trained_from(trained_from_writer(12))
    ('v12', 12)
    """
    return f"{TRAINED_FROM}{int(version)}"


def trained_from(writer: str) -> int:
    """The version a stream contribution was trained from, from its writer id (:func:`trained_from_writer`)."""
    if not writer.startswith(TRAINED_FROM) or not writer[len(TRAINED_FROM):].isdigit():
        raise ValueError(f"not a stream contribution's writer id: {writer!r}")
    return int(writer[len(TRAINED_FROM):])
