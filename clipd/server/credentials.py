"""Who may do what: the admin credential and per-aggregation submit tokens.

Two roles. The **admin** (``Settings.admin_token``) may do everything: create,
finalize, cancel, read results and statistics, and submit. A **submit token**
is returned when an aggregation is created and lets its holder submit to that
aggregation only: it is refused for any other aggregation and for every other
RPC. With no admin token set, authentication is off (and the server listens on
loopback only, unless told ``insecure``).

A submit token is an HMAC of the aggregation's id and creation time under a
server key kept in the data directory, so it needs no storage of its own, is
the same for every call that describes the aggregation, survives a restart, and
dies with the aggregation (a re-created id has another creation time). Every
comparison is constant-time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import pathlib
import secrets

from clipd import wire

KEY_FILE = "submit-token.key"
TOKEN_PREFIX = "cst1_"


def bearer_token(metadata) -> str | None:
    """The token of an ``authorization: Bearer <token>`` entry of gRPC metadata or HTTP headers."""
    for key, value in metadata or ():
        if key.lower() == wire.AUTHORIZATION_KEY and value[:len(wire.BEARER)].lower() == wire.BEARER.lower():
            return value[len(wire.BEARER):].strip()
    return None


def same(given: str | None, expected: str) -> bool:
    """Constant-time equality of two secrets (``given`` None never matches)."""
    if given is None or not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def load_key(data_dir: str) -> bytes:
    """The server's submit-token key: ``<data_dir>/submit-token.key`` (0600), made on first use.

    The embedded store's (``SQLiteStore.submit_token_key``); the memory store
    makes one per process, PostgreSQL keeps it in the database.
    """
    path = pathlib.Path(data_dir) / KEY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_bytes()
        if len(key) != 32:
            raise ValueError(f"{path}: a submit-token key is 32 bytes, found {len(key)}") from None
        return key
    key = secrets.token_bytes(32)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
        f.flush()
        os.fsync(f.fileno())
    return key


class SubmitTokens:
    """Makes and checks per-aggregation submit tokens.

    >>> tokens = SubmitTokens(b"k" * 32)
    >>> token = tokens.token_for("round-7", 1700000000.5)
    >>> token.startswith("cst1_"), tokens.check(token, "round-7", 1700000000.5)
    (True, True)
    >>> tokens.check(token, "round-8", 1700000000.5), tokens.check(token, "round-7", 1700000001.0)
    (False, False)
    """

    def __init__(self, key: bytes) -> None:
        self._key = key

    def token_for(self, aggregation_id: str, created: float) -> str:
        message = f"submit\n{aggregation_id}\n{created!r}".encode()
        digest = hmac.new(self._key, message, hashlib.sha256).digest()
        return TOKEN_PREFIX + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def check(self, token: str | None, aggregation_id: str, created: float) -> bool:
        return same(token, self.token_for(aggregation_id, created))
