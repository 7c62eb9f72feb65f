"""Who may do what: the admin credential, per-aggregation submit tokens, client tokens, client certificates.

The **admin** (``Settings.admin_token``) may do everything: create,
finalize, cancel, read results and statistics, issue client tokens, and submit
under any client id. A **submit token** is returned when an aggregation is
created and lets its holder submit to that aggregation only: it is refused for
any other aggregation and for every other RPC. A **client token**
(:class:`ClientToken`, issued by the admin) lets its holder submit as one client
id to one aggregation, or to every aggregation of one ledger; a **submitter
token** (the same, role ``submitter``) may name any client id there, for a
framework that authenticates its own nodes. With mutual TLS, a client
certificate's subject Common Name is its holder's client id. With no admin
token set, authentication is off (and the server listens on loopback only,
unless told ``insecure``). docs/threat-model.md says what each role can do.

A submit token is an HMAC of the aggregation's id and creation time under a
server key kept in the data directory, so it needs no storage of its own, is
the same for every call that describes the aggregation, survives a restart, and
dies with the aggregation (a re-created id has another creation time). Every
comparison is constant-time.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import json
import os
import pathlib
import secrets
import time

from clipd import wire

KEY_FILE = "submit-token.key"
TOKEN_PREFIX = "cst1_"
CLIENT_TOKEN_PREFIX = wire.CLIENT_TOKEN_PREFIX
CLIENT, SUBMITTER = "client", "submitter"  # the roles of a client token
# Metadata a clipd process adds to a call it forwards to another: the client id of the caller's verified client
# certificate, and its MAC under the server's key (so the receiving process trusts it from clipd only).
CERTIFIED_CLIENT_METADATA = "x-clipd-certified-client"


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
        self.key = key  # the server's key (ClientTokens derive theirs from it)

    def token_for(self, aggregation_id: str, created: float) -> str:
        message = f"submit\n{aggregation_id}\n{created!r}".encode()
        digest = hmac.new(self.key, message, hashlib.sha256).digest()
        return TOKEN_PREFIX + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def check(self, token: str | None, aggregation_id: str, created: float) -> bool:
        return same(token, self.token_for(aggregation_id, created))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclasses.dataclass(frozen=True)
class ClientToken:
    """What a client token says: its ``role`` (``client``: submits as ``client_id`` only; ``submitter``: may
    name any client id), its scope (one aggregation, with its creation time, or one ledger's aggregations)
    and when it expires (0: never)."""

    role: str
    client_id: str
    aggregation_id: str = ""
    created: float = 0.0  # the aggregation's creation time (an aggregation re-created under its id is another)
    ledger_id: str = ""
    expires: float = 0.0

    def covers(self, aggregation_id: str, created: float | None, ledger_id: str | None) -> bool:
        """Whether it may submit to the aggregation ``aggregation_id`` (created at ``created``, of ledger
        ``ledger_id``; None: not private), and has not expired."""
        if self.expires and time.time() >= self.expires:
            return False
        if self.aggregation_id:
            return self.aggregation_id == aggregation_id and created is not None and self.created == created
        return bool(self.ledger_id) and self.ledger_id == ledger_id


class ClientTokens:
    """Makes and reads client tokens, and vouches for a certificate's client id between clipd's processes.

    A token is ``cct1_<payload>.<mac>``: its fields as JSON (readable: the client library takes its client id
    from it) and an HMAC-SHA256 of them under the server's key, so no one without the key can make or change
    one, and the server needs no storage to check it. It dies with its aggregation (a re-created id has another
    creation time), at its expiry, or when the key changes.

    >>> tokens = ClientTokens(b"k" * 32)
    >>> token = tokens.issue(ClientToken(CLIENT, "alice", aggregation_id="round-7", created=1.5))
    >>> tokens.read(token).client_id, tokens.read(token).covers("round-7", 1.5, None)
    ('alice', True)
    >>> tokens.read(token[:-2] + "xx") is None, tokens.read(token).covers("round-8", 1.5, None)
    (True, False)
    """

    def __init__(self, key: bytes) -> None:
        self._key = hmac.new(key, b"clipd client tokens", hashlib.sha256).digest()  # not the submit tokens' key

    def _mac(self, message: bytes) -> str:
        return _b64(hmac.new(self._key, message, hashlib.sha256).digest())

    def issue(self, token: ClientToken) -> str:
        payload = _b64(json.dumps(dataclasses.asdict(token), separators=(",", ":"), sort_keys=True).encode())
        return f"{CLIENT_TOKEN_PREFIX}{payload}.{self._mac(payload.encode())}"

    def read(self, token: str | None) -> ClientToken | None:
        """The token's fields if it is one this server issued (its MAC checks), else None (expired ones too:
        see :meth:`ClientToken.covers`)."""
        if not token or not token.startswith(CLIENT_TOKEN_PREFIX):
            return None
        payload, _, mac = token[len(CLIENT_TOKEN_PREFIX):].partition(".")
        if not same(mac, self._mac(payload.encode())):
            return None
        try:
            return ClientToken(**json.loads(_unb64(payload)))
        except (ValueError, TypeError, binascii.Error):
            return None

    def vouch(self, client_id: str) -> str:
        """The value of ``x-clipd-certified-client`` for a forwarded call whose caller's certificate names
        ``client_id``."""
        return f"{_b64(client_id.encode())}.{self._mac(b'certified-client' + client_id.encode())}"

    def vouched(self, value: str | None) -> str | None:
        """The client id a ``vouch`` value names, if a clipd process of this server made it."""
        if not value:
            return None
        encoded, _, mac = value.partition(".")
        try:
            client_id = _unb64(encoded).decode()
        except (ValueError, binascii.Error):
            return None
        return client_id if same(mac, self._mac(b"certified-client" + client_id.encode())) else None


def certificate_client_id(context) -> str | None:
    """The client id of the caller's verified client certificate (mutual TLS): its subject Common Name.
    None on a plaintext or server-only TLS connection (gRPC verified the certificate against the client CA
    before the call began)."""
    try:
        auth = context.auth_context() or {}
    except Exception:  # (a context without one)
        return None
    names = auth.get("x509_common_name") or []
    return names[0].decode() if names else None
