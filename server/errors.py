"""Domain errors of the service, each with its gRPC status code (mapped in one place)."""

from __future__ import annotations

import grpc


class ClipdError(Exception):
    """A request the service refuses; ``code`` is the gRPC status it maps to."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ClipdError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ClipdError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ClipdError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ClipdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ClipdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ClipdError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ClipdError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
