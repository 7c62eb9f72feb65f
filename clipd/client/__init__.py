"""clipd.client: the Python client of clipd (depends on the generated gRPC code and numpy only)."""

from . import errors
from ._client import AggregateResult, Client, SubmitProgress, SubmitReport
from .errors import (
    AlreadyExistsError,
    ClipdError,
    FailedPreconditionError,
    InvalidArgumentError,
    InvalidUpdateError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from .privacy import Adaptive, Audit, Privacy
from .streams import Buffer, StreamAck, StreamRelease
from .updates import Layer, layers_like

__all__ = [
    "Adaptive",
    "Audit",
    "Buffer",
    "StreamAck",
    "StreamRelease",
    "Privacy",
    "AggregateResult",
    "AlreadyExistsError",
    "Client",
    "ClipdError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "InvalidUpdateError",
    "Layer",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "SubmitProgress",
    "SubmitReport",
    "UnauthenticatedError",
    "UnavailableError",
    "errors",
    "layers_like",
]
