"""Domain errors of the service, each with its gRPC status code (mapped in one place)."""

from __future__ import annotations

import grpc

from clipd import wire


class ClipdError(Exception):
    """A request the service refuses; ``code`` is the gRPC status it maps to.

    ``retry_after`` (seconds) marks a refusal about the server's load, not the
    request: it goes to the client as the trailing metadata ``retry-after-ms``.
    """

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return wire.retry_after_metadata(self.retry_after) if self.retry_after is not None else ()


class InvalidArgument(ClipdError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ClipdError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ClipdError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ClipdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Behind(FailedPrecondition):
    """A one-message batch numbered at or below what its client already has (another submission's): the client
    numbers after ``accepted`` (the trailing metadata ``accepted-sequence``), or opens a Submit stream."""

    def __init__(self, message: str, accepted: int) -> None:
        super().__init__(message)
        self.accepted = accepted

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((wire.ACCEPTED_SEQUENCE_KEY, str(self.accepted)),)


class ResourceExhausted(ClipdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ClipdError):
    code = grpc.StatusCode.UNAVAILABLE


class PermissionDenied(ClipdError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(ClipdError):
    code = grpc.StatusCode.UNAUTHENTICATED


class DeadlineExceeded(ClipdError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unimplemented(ClipdError):
    """A call this server's configuration can't serve (the caller has another way: the message says which)."""

    code = grpc.StatusCode.UNIMPLEMENTED
