"""The protocol between the control process and the processes that sum (its shard hosts), on the control's side:
the calls (the ``ShardHost`` service of proto/clipd/server/internal/v1/shard_host.proto), how a failed call becomes
an error, and the statistics and loads the hosts report, converted.

A shard host, whatever launched it (a local subprocess, a Ray actor), answers the same messages: over its
private unix socket, or serialized through its actor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc
import numpy as np

from clipd.engine import PartialState
from clipd.server.errors import ClipdError, DeadlineExceeded, FailedPrecondition, NotFound, Unavailable
from clipd.server.internal.v1 import shard_host_pb2 as host_pb
from clipd.v1 import clipd_pb2

SERVICE = clipd_pb2.DESCRIPTOR.services_by_name["Clipd"]
# The control's calls to a shard host (proto/clipd/server/internal/v1/shard_host.proto), by name: request and
# answer types.
CALLS: dict[str, tuple[Any, Any]] = {
    "Open": (host_pb.OpenRequest, host_pb.OpenResponse),
    "Finish": (host_pb.FinishRequest, host_pb.FinishResponse),
    "Stats": (host_pb.StatsRequest, host_pb.StatsResponse),
    "Forget": (host_pb.ForgetRequest, host_pb.ForgetResponse),
    "Serve": (host_pb.ServeRequest, host_pb.ServeResponse),
}
_STAT_COUNTS = ("examples", "non_finite", "batches", "bytes")
_STAT_ARRAYS = ("clip_counts", "layer_histograms", "example_histogram", "norm_sum", "norm_max")

# A host's refusal that the control raises as such; any other failure of a call is the host's: Unavailable.
_ERRORS = {grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition, grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
           grpc.StatusCode.NOT_FOUND: NotFound}


def host_error(host: str, code: grpc.StatusCode, message: str) -> ClipdError:
    """The error a failed call to a shard host raises on the control's side: the host's own refusal as it said
    it, anything else (the host unreachable, restarting, a timeout) as ``Unavailable``."""
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
        return _ERRORS[code](message)
    return _ERRORS.get(code, Unavailable)(f"{host}: {code.name}: {message}")


def stats_to_proto(state: PartialState) -> host_pb.ShardStats:
    """A shard's statistics (no sums, no client marks) for the control process."""
    fields: dict[str, Any] = {f: int(getattr(state, f)) for f in _STAT_COUNTS}
    fields.update({f: getattr(state, f).ravel().tolist() for f in _STAT_ARRAYS})
    return host_pb.ShardStats(**fields)


def stats_from_proto(empty: PartialState, stats: host_pb.ShardStats) -> PartialState:
    """:func:`stats_to_proto`'s shard as a partial state whose sums stay zero (read from checkpoints at finalize)."""
    fields: dict[str, Any] = {f: int(getattr(stats, f)) for f in _STAT_COUNTS}
    fields.update({f: np.asarray(getattr(stats, f), getattr(empty, f).dtype).reshape(getattr(empty, f).shape)
                   for f in _STAT_ARRAYS})
    return dataclasses.replace(empty, **fields)


def sum_loads(loads: list[host_pb.Load]) -> host_pb.Load:
    """Processes' loads added up, field by field (the refusal maps key by key).

    >>> total = sum_loads([host_pb.Load(active_streams=2, rejections={"INVALID_ARGUMENT": 1}),
    ...                    host_pb.Load(active_streams=3, rejections={"INVALID_ARGUMENT": 4, "UNAVAILABLE": 1})])
    >>> total.active_streams, dict(sorted(total.rejections.items()))
    (5, {'INVALID_ARGUMENT': 5, 'UNAVAILABLE': 1})
    """
    total = host_pb.Load()
    for load in loads:
        for field in ("active_streams", "stream_limit", "refused_streams", "buffered_bytes", "buffer_limit",
                      "refused_batches", "one_message_held", "one_message_limit", "refused_one_message"):
            setattr(total, field, getattr(total, field) + getattr(load, field))
        for name in ("rejections", "participation_refusals"):
            into = getattr(total, name)
            for key, count in getattr(load, name).items():
                into[key] += count
    return total


def one_message(load: host_pb.Load) -> dict:
    """One-message submissions (SubmitOne) as the admin API shows them: held (running or waiting), the limit of
    those, refused with an appointment."""
    return {"held": load.one_message_held, "limit": load.one_message_limit, "refused": load.refused_one_message}


def describe_load(load: host_pb.Load | None) -> dict:
    """A shard process's load as the admin API shows it; every value None until it reported (``load`` None)."""
    if load is None:
        return {"streams": None, "one_message": None, "buffered_bytes": None, "refused_batches": None,
                "rejections": None, "participation_refusals": None}
    return {"streams": {"active": load.active_streams, "limit": load.stream_limit, "refused": load.refused_streams},
            "one_message": one_message(load),
            "buffered_bytes": {"used": load.buffered_bytes, "limit": load.buffer_limit},
            "refused_batches": load.refused_batches, "rejections": dict(sorted(load.rejections.items())),
            "participation_refusals": dict(sorted(load.participation_refusals.items()))}
