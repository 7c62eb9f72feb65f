"""Who a caller is and what it may do: one place for every credential the server takes.

- the **admin token** (``Settings.admin_token``): everything; with none set, authentication is off;
- an aggregation's **submit token** (:class:`~clipd.server.credentials.SubmitTokens`): Submit to it;
- a **client token** (:class:`~clipd.server.credentials.ClientTokens`, issued by the admin): Submit as its client
  id to its aggregation or ledger; a **submitter token** names any client id there;
- a **client certificate** (mutual TLS): its Common Name is its holder's client id where identities count.

The :class:`~clipd.server.rpc.server.Guard` refuses, before any handler runs, a call that no credential of this
server may make; the handlers ask :class:`Authenticator` about the aggregation a call names (a token's scope is an
aggregation or a ledger, which only the request says) and about the client id a Submit stream counts under.
docs/threat-model.md says what each role can do.
"""

from __future__ import annotations

import math
import time

from clipd import wire
from clipd.server.aggregations import SELF_ASSERTED, Aggregation
from clipd.server.credentials import (
    CERTIFIED_CLIENT_METADATA,
    CLIENT,
    SUBMITTER,
    ClientToken,
    ClientTokens,
    SubmitTokens,
    certificate_client_id,
    same,
)
from clipd.server.errors import InvalidArgument, NotFound, PermissionDenied, Unauthenticated
from clipd.server.rpc import codec
from clipd.server.sequences import client_of
from clipd.v1 import clipd_pb2 as pb


class Authenticator:
    """The server's credentials, checked against the aggregations of ``registry`` (see the module)."""

    def __init__(self, admin_token: str, registry, submit_tokens: SubmitTokens, mutual_tls: bool = False) -> None:
        self.admin_token = admin_token
        self.registry = registry
        self.submit_tokens = submit_tokens
        self.client_tokens = ClientTokens(submit_tokens.key)
        self.mutual_tls = mutual_tls

    def issue(self, request: pb.IssueClientTokenRequest) -> pb.ClientToken:
        """A client token (or a submitter token) for the request's aggregation or ledger: IssueClientToken."""
        if request.role not in wire.TOKEN_ROLES.values():
            raise InvalidArgument(f"role: unknown value {request.role} (CLIENT or SUBMITTER)")
        role = CLIENT if request.role == pb.IssueClientTokenRequest.CLIENT else SUBMITTER
        if bool(request.aggregation_id) == bool(request.ledger_id):
            raise InvalidArgument("give one of aggregation_id (a token for that aggregation) and ledger_id (for every"
                                  " aggregation of that ledger)")
        client_id = check_id(request.client_id, "client_id") if role == CLIENT else ""
        if role == SUBMITTER and request.client_id:
            raise InvalidArgument("client_id: a submitter token names no client (it may submit as any)")
        if not (request.ttl_seconds >= 0 and math.isfinite(request.ttl_seconds)):
            raise InvalidArgument(f"ttl_seconds: finite and >= 0 (0: no expiry), got {request.ttl_seconds}")
        expires = time.time() + request.ttl_seconds if request.ttl_seconds else 0.0
        if request.aggregation_id:
            scope = self.registry.scope(request.aggregation_id)
            if scope is None:
                raise NotFound(f"no aggregation {request.aggregation_id!r}")
            token = ClientToken(role, client_id, aggregation_id=request.aggregation_id, created=scope[0],
                                expires=expires)
        else:
            token = ClientToken(role, client_id, ledger_id=codec.ledger_id(request.ledger_id), expires=expires)
        return pb.ClientToken(token=self.client_tokens.issue(token), client_id=client_id,
                              aggregation_id=token.aggregation_id, ledger_id=token.ledger_id, role=request.role,
                              expires_unix_seconds=expires)

    def is_admin(self, token: str | None) -> bool:
        """Auth off, or the admin token."""
        return not self.admin_token or same(token, self.admin_token)

    def authorize(self, token: str | None, aggregation_id: str, action: str) -> None:
        """Refuses unless ``token`` is the admin's, the submit token of ``aggregation_id``, or a client token
        whose scope covers it.

        No token, or one that is no credential of this server (or an expired client token): UNAUTHENTICATED.
        A submit token of another aggregation, a client token for another aggregation or ledger:
        PERMISSION_DENIED (as for an unknown id, so ids do not leak to holders of other tokens).
        """
        scope = self.registry.scope(aggregation_id) if token is not None else None
        if self.may_submit(token, aggregation_id, scope):
            return
        client = self.client_tokens.read(token)
        if client is not None and client.expires and client.expires <= time.time():
            expired = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(client.expires))
            raise Unauthenticated(f"this client token expired at {expired}; ask the admin for a new one")
        if token is None or not self.is_credential(token):
            raise Unauthenticated("a valid 'authorization: Bearer <token>' is required")
        raise PermissionDenied(f"this token may not {action} aggregation {aggregation_id!r}")

    def may_submit(self, token: str | None, aggregation_id: str, scope: tuple[float, str | None] | None) -> bool:
        """The admin token, the submit token of ``aggregation_id``, or a client token that covers it (``scope``:
        its creation time and ledger, ``Registry.scope``; None: unknown)."""
        if self.is_admin(token):
            return True
        if token is None or scope is None:
            return False
        created, ledger = scope
        if self.submit_tokens.check(token, aggregation_id, created):
            return True
        client = self.client_tokens.read(token)
        return client is not None and client.covers(aggregation_id, created, ledger)

    def is_credential(self, token: str) -> bool:
        """The admin token, a client token of this server, or the submit token of some aggregation of it."""
        return self.is_admin(token) or self.client_tokens.read(token) is not None or any(
            self.submit_tokens.check(token, i, created) for i, created in self.registry.identities())

    # Who a client is ------------------------------------------------------------------------------
    def certified_client(self, context) -> str | None:
        """The client id of the caller's client certificate (mutual TLS: its Common Name), as this process's
        TLS verified it or, on a call another clipd process forwarded, as that one vouched for it."""
        for key, value in context.invocation_metadata() or ():
            if key == CERTIFIED_CLIENT_METADATA:
                return self.client_tokens.vouched(value)
        return certificate_client_id(context) if self.mutual_tls else None

    def credential_client_id(self, token: str | None, context) -> str | None:
        """The client id a stream's credential names, if any: its client token's, else its certificate's."""
        client = self.client_tokens.read(token)
        if client is not None and client.role == CLIENT:
            return client.client_id
        return self.certified_client(context)

    def client_identity(self, token: str | None, certified: str | None, aggregation: Aggregation, named: str) -> str:
        """The client id a Submit stream is counted under (docs/threat-model.md).

        A client token's (the stream may name it, one of its spread ids, or nothing); the named one for a trusted
        submitter (the admin, a submitter token, or anyone on a server without auth) and wherever identities do
        not count; on an aggregation that counts them (unit CLIENT, or a correlated stream's enforced
        participation), the client certificate's (named, or not named), else the named one only if the
        aggregation takes self-asserted ids. Anything else is PERMISSION_DENIED, saying which credential to use.
        """
        client = self.client_tokens.read(token)
        if client is not None and client.role == CLIENT:
            return _as_credential(client.client_id, named, "this client token")
        if self.is_admin(token) or (client is not None and client.role == SUBMITTER) \
                or not aggregation.counts_identities:
            return check_client_id(named)
        if certified is not None and not (aggregation.client_ids == SELF_ASSERTED and named):
            if not codec.ID_PATTERN.match(certified):
                raise PermissionDenied(f"the client certificate's Common Name {certified[:64]!r} is not a client id"
                                       " (1-128 letters, digits, '-', '_' or '.')")
            return _as_credential(certified, named, "the client certificate")
        if aggregation.client_ids == SELF_ASSERTED:
            return check_client_id(named)
        limits = "; ".join(aggregation.spec.identity_limits)
        raise PermissionDenied(
            f"aggregation {aggregation.id} counts client identities ({limits}), so a client id comes from a"
            " credential: submit with a client token (the admin issues one: IssueClientToken, `clipd token`), or"
            " with a client certificate (mutual TLS); its submit token may not name client ids unless it was created"
            " with self_asserted_client_ids")


def _as_credential(client_id: str, named: str, what: str) -> str:
    """``named`` if it is the credential's ``client_id`` or one of its spread ids, the credential's if empty."""
    if not named:
        return client_id
    if named != client_id and client_of(check_client_id(named)) != client_id:
        raise PermissionDenied(f"{what} is for client {client_id!r}; it may not submit as {named!r}")
    return named


def check_client_id(value: str) -> str:
    """A client id, or one stream of a spread submission: ``<client id>~<stream number>`` (``alice~3``)."""
    base, mark, stream = value.rpartition(wire.SPREAD_MARK)
    if mark and stream.isdigit() and len(stream) <= 6 and codec.ID_PATTERN.match(base) and stream[0] != "0":
        return value
    return check_id(value, "client_id")


def check_id(value: str, what: str) -> str:
    """``value`` if it is an id (1-128 letters, digits, '-', '_' or '.'), else INVALID_ARGUMENT naming ``what``."""
    if not codec.ID_PATTERN.match(value):
        raise InvalidArgument(f"{what}: 1-128 letters, digits, '-', '_' or '.', got {value!r}")
    return value
