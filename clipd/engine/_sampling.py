"""Poisson sampling drawn by a keyed function: who takes part in a release is the key holder's coin.

Amplification by Poisson sampling (each unit in a release independently with probability ``q``) holds only if
the coin is not the adversary's. A server that draws it itself, and refuses the units it did not draw, makes
the claim hold whatever its caller does: the caller can leave drawn units out (utility), never add one.

Unit ``u`` takes part in release ``t`` of ledger ``L`` iff

    U(t, u) = first 8 bytes of HMAC-SHA256(key, "clipd-draw/1" 0 L 0 t 0 u), big-endian, / 2^64  <  q

(``0`` a zero byte, ``t`` in decimal, strings in UTF-8). HMAC-SHA256 under a secret key is a pseudorandom
function: without the key, the draws of different (t, u) are independent uniform coins, and no choice of ids
steers them. The same (key, L, t, u) always gives the same draw: asking again, or re-presenting a refused
unit, changes nothing.

>>> key = bytes(32)
>>> draw_values(key, "run-1", 3, ["alice", "bob"]).round(4).tolist()
[0.7121, 0.2964]
>>> drawn(key, "run-1", 3, ["alice", "bob"], 0.5).tolist()
[False, True]
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

import numpy as np

DOMAIN = b"clipd-draw/1"


def draw_values(key: bytes, ledger_id: str, release: int, units: Sequence[str]) -> np.ndarray:
    """float64 ``(len(units),)``: each unit's uniform ``U(t, u)`` in [0, 1) for release ``release`` (1-based)."""
    prefix = b"\0".join([DOMAIN, ledger_id.encode(), str(int(release)).encode(), b""])
    mac = hmac.new(key, digestmod=hashlib.sha256)
    out = np.empty(len(units), np.float64)
    for i, unit in enumerate(units):
        h = mac.copy()
        h.update(prefix + unit.encode())
        out[i] = int.from_bytes(h.digest()[:8], "big") / 2.0 ** 64
    return out


def drawn(key: bytes, ledger_id: str, release: int, units: Sequence[str], rate: float) -> np.ndarray:
    """bool ``(len(units),)``: which units take part in release ``release`` at Poisson rate ``rate``."""
    return draw_values(key, ledger_id, release, units) < rate
