"""Typed client errors: ``grpc.RpcError`` is translated once, here, by status code."""

from __future__ import annotations

import grpc

from clipd import wire


class ClipdError(Exception):
    """An RPC failed; ``code`` is its gRPC status, ``details`` the server's message."""

    code: grpc.StatusCode | None = None
    retryable = False
    retry_after: float | None = None  # seconds, when the server asked to be retried after that long

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code


class InvalidArgumentError(ClipdError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class InvalidUpdateError(InvalidArgumentError, ValueError):
    """An update does not fit the aggregation's layers; found by the client, before anything is sent.

    ``layer`` names the layer at fault ("" when the update as a whole is wrong),
    ``expected`` and ``got`` say what the aggregation wants and what came.
    """

    def __init__(self, details: str, *, layer: str = "", expected=None, got=None) -> None:
        super().__init__(details)
        self.layer = layer
        self.expected = expected
        self.got = got


class NotFoundError(ClipdError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(ClipdError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPreconditionError(ClipdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(ClipdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnauthenticatedError(ClipdError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(ClipdError):
    """The credential is valid but not for this: e.g. a submit token used to finalize, or for another aggregation."""

    code = grpc.StatusCode.PERMISSION_DENIED


class UnavailableError(ClipdError):
    """The server could not be reached or the connection dropped: safe to retry a stream."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


_BY_CODE = {
    cls.code: cls
    for cls in (InvalidArgumentError, NotFoundError, AlreadyExistsError, FailedPreconditionError,
                ResourceExhaustedError, UnauthenticatedError, PermissionDeniedError, UnavailableError)
}
# A dropped connection may also surface as these; the stream protocol makes resending safe.
_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}


def from_rpc_error(error: grpc.RpcError) -> ClipdError:
    """The typed error; a refusal with ``retry-after-ms`` (server busy) is retryable after that long."""
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    cls = _BY_CODE.get(code, ClipdError)
    err = cls(details, code)
    err.retry_after = wire.retry_after(error.trailing_metadata() if hasattr(error, "trailing_metadata") else None)
    err.retryable = code in _TRANSIENT or err.retry_after is not None
    return err
