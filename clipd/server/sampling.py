"""Sampling the server draws: its secret, each release's draws, and the refusal of a client it did not draw.

A ledger whose policy says ``Sampling(kind=POISSON, drawn_by=SERVER)`` takes each release's participants from
the server's own coin (``engine._sampling``: HMAC-SHA256 of ledger, release and client id under a secret key),
not from the caller's word. The key is derived from the store's key (``Store.submit_token_key``: made once,
kept with the store, the same for every process of a deployment), so every process draws alike and a restart
draws as before; it is never shown, logged or put in a response. The release a draw is for is the ledger's
next one (its committed releases plus one): such a ledger makes its releases one aggregation at a time
(``Ledgers.admit``), so an aggregation's draws are fixed from its creation to its release, and cancelling it
and making another one draws the same clients again.

>>> draws = Draws(lambda: bytes(32))
>>> draws.drawn("run-1", 3, ["alice", "bob"], 0.5).tolist() == draws.drawn("run-1", 3, ["alice", "bob"], 0.5).tolist()
True
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence

import numpy as np

from clipd.engine import _sampling as sampling

KEY_DOMAIN = b"clipd-sampling-key/1"  # the draws' key: HMAC-SHA256(store key, KEY_DOMAIN): a key of its own
MAX_CANDIDATES = 100_000  # candidates one DrawClients call may ask about


class Draws:
    """The server's draws: ``store_key`` gives the store's key (read once, when first needed)."""

    def __init__(self, store_key: Callable[[], bytes]) -> None:
        self._store_key = store_key
        self._key: bytes | None = None

    def _derived(self) -> bytes:
        if self._key is None:  # (two threads at once derive the same key: no lock needed)
            self._key = hmac.new(self._store_key(), KEY_DOMAIN, hashlib.sha256).digest()
        return self._key

    def drawn(self, ledger_id: str, release: int, clients: Sequence[str], rate: float) -> np.ndarray:
        """bool ``(len(clients),)``: which clients take part in release ``release`` (1-based) of the ledger."""
        return sampling.drawn(self._derived(), ledger_id, release, clients, rate)

    def __repr__(self) -> str:  # never its key
        return "Draws(<key withheld>)"
