"""Shard processes: ``clipd serve --processes N``. The process that receives a batch clips and sums it.

Layout (one host)::

    routed client --TCP--> shard process i, its own port  ------------------+
    (GetPlacement)                                                           |
    plain client  --TCP--> the public port (SO_REUSEPORT: every shard        |
                           process listens; the kernel picks one)            |
                              | a Submit for another process's shard:        |
                              +--unix socket--> that shard process ----------+
                                                                             v
        shard process i: parse, check the token, sequence numbers, clip and sum on its device,
        checkpoint its shards (the shards s with s % N == i) to the store, acknowledge
    every other RPC (create, stats, finalize, ...) --unix socket, byte for byte--> the control process

The control process (``clipd serve`` itself) holds the control plane and never
sees a payload byte: it creates aggregations in the store, reads the shard
processes' statistics (polled twice a second), finalizes (below), releases
with noise, keeps the ledgers, serves the admin API and supervises the shard
processes. Each shard process opens an aggregation from the store the first
time it needs it (a Submit, the control's ``Open`` or ``Finish``), claims an
epoch for each of its shards and restores them from their newest checkpoints:
so a restarted shard process carries on where its last checkpoint stopped, and
its clients resend what was not acknowledged (exactly once, per shard).

Placement (Kafka's leader metadata, static here): shard ``s`` lives in process
``s % N``; ``GetPlacement`` gives every shard's endpoint (``advertise_host``
and the process's own port, kept across its restarts). A client that does not
route still works through the public port: a Submit that lands on a process
that does not own its shard is forwarded over a unix socket, one extra hop
through a second process for (N-1)/N of such streams.

Finalize: the control marks the aggregation CLOSING in the store (a shard
process opens a CLOSING aggregation for no more batches), asks every shard
process to ``Finish`` (it stops taking batches, sums what it accepted and
commits its shards' final checkpoints), claims a new epoch for every shard (so
no checkpoint of a shard process, a restarted one included, can land after
this point) and merges the final checkpoints it reads back from the store.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import grpc
import numpy as np

from clipd import wire
from clipd.engine import PartialState
from clipd.server.aggregations import (
    TAKES_BATCHES,
    Aggregation,
    AggregationSpec,
    Registry,
    State,
)
from clipd.server.credentials import bearer_token
from clipd.server.errors import (
    ClipdError,
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    Unavailable,
)
from clipd.server.lifecycle import Lifecycle, fail
from clipd.server.privacy import Ledgers
from clipd.server.rpc.submit import stream_owner
from clipd.server.settings import Settings
from clipd.server.shards.forward import _pass, _pass_unary, passing_through
from clipd.server.shards.local import owner_of
from clipd.server.stores.base import CLOSING, FAILED, FINALIZED, Store
from clipd.server.tls import peer_channel
from clipd.v1 import clipd_pb2
from clipd.v1 import shard_host_pb2 as host_pb
from clipd.v1 import shard_host_pb2_grpc as host_grpc

log = logging.getLogger(__name__)
SERVICE = clipd_pb2.DESCRIPTOR.services_by_name["Clipd"]
# The control's calls to a shard host (proto/clipd/v1/shard_host.proto), by name: request and answer types.
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


class _ShardHostService(host_grpc.ShardHostServicer):
    """The ShardHost service on a shard process's private socket: each call runs on the process; a
    ``ClipdError`` it raises is the call's status."""

    def __init__(self, process: ShardProcess) -> None:
        self.process = process

    def _run(self, name: str, request, context):
        try:
            return self.process.handle(name, request)
        except ClipdError as e:
            context.abort(e.code, str(e))

    def Open(self, request, context):  # noqa: N802 (the generated servicer's names)
        return self._run("Open", request, context)

    def Finish(self, request, context):  # noqa: N802
        return self._run("Finish", request, context)

    def Stats(self, request, context):  # noqa: N802
        return self._run("Stats", request, context)

    def Forget(self, request, context):  # noqa: N802
        return self._run("Forget", request, context)

    def Serve(self, request, context):  # noqa: N802
        return self._run("Serve", request, context)


# The shard process ------------------------------------------------------------------------------------
class _FirstMessage:
    """A stream's first message, read on a thread of its own, so that waiting for it is bounded and evictable."""

    NOTHING = object()  # nothing came in time, or the stream's slot went to another client

    def __init__(self, requests) -> None:
        self._requests, self._done = requests, threading.Event()
        self._got: list = []
        self._since = time.monotonic()

    def _read(self) -> None:
        try:
            self._got.append(next(self._requests, None))
        except Exception:  # the call ended (cancelled, reset): nothing to read
            self._got.append(None)
        self._done.set()

    def take(self, timeout: float):
        threading.Thread(target=self._read, name="clipd-first-message", daemon=True).start()
        self._done.wait(timeout)
        return self._got[0] if self._got else self.NOTHING

    def idle_since(self) -> float:
        return self._since

    def evict(self) -> None:
        self._done.set()


def record_scope(record) -> tuple[float, str | None]:
    """What a credential for a stored aggregation is bound to: its creation time and its ledger."""
    privacy = AggregationSpec.from_json(record.spec).privacy
    return record.created, privacy.ledger_id if privacy is not None else None


class _ShardRegistry(Registry):
    """A shard process's aggregations, each opened from the store the first time it is asked for."""

    def __init__(self, store, open_from_store) -> None:
        super().__init__(max_aggregations=1 << 30)  # the control process enforces the limits at create
        self._store = store
        self._open_from_store = open_from_store
        self._opening = threading.Lock()

    def get(self, aggregation_id: str) -> Aggregation:
        with contextlib.suppress(NotFound):
            return super().get(aggregation_id)
        with self._opening:  # one opening at a time: two would claim the shards twice
            with contextlib.suppress(NotFound):
                return super().get(aggregation_id)
            aggregation = self._open_from_store(aggregation_id)
            self.add(aggregation)
            return aggregation

    def created(self, aggregation_id: str) -> float | None:
        """From the store's record: an aggregation this process has not opened (or has dropped, finalized)
        is still one whose submit token is known here."""
        created = super().created(aggregation_id)
        if created is None:
            record = self._store.get(aggregation_id)
            created = None if record is None else record.created
        return created

    def identities(self) -> list[tuple[str, float]]:
        return [(r.aggregation_id, r.created) for r in self._store.records()]

    def scope(self, aggregation_id: str) -> tuple[float, str | None] | None:
        """From the store's record, as :meth:`created`."""
        scope = super().scope(aggregation_id)
        if scope is None:
            record = self._store.get(aggregation_id)
            scope = None if record is None else record_scope(record)
        return scope


class ShardProcess:
    """One shard process: its own gRPC ports, device workers and partial states; see the module doc."""

    def __init__(self, settings: Settings, index: int, public_port: int, data_port: int, private_dir: str | None,
                 control: str | None = None) -> None:
        """``private_dir``: the unix sockets of ``--processes``; None on Ray
        (:class:`clipd.server.shards.ray_hosts.ShardHost`):
        ``control`` is then the server's address, the siblings' are set by :meth:`set_siblings` and the
        control's calls are the actor's methods."""
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        from clipd.server.credentials import SubmitTokens
        from clipd.server.rpc.codec import Malformed, lenient
        from clipd.server.rpc.reflection import enable_reflection
        from clipd.server.rpc.server import OTHER_STREAMS, Guard, server_options
        from clipd.server.rpc.service import ClipdServicer
        from clipd.server.shards.local import Devices
        from clipd.server.stores import open_store
        from clipd.server.tls import grpc_server_credentials

        self.settings, self.index, self.count = settings, index, settings.processes
        self.private_dir = private_dir
        self._malformed, self._parse = Malformed, lenient(wire.parse_submit_request)
        if settings.compilation_cache_dir:
            import jax

            jax.config.update("jax_compilation_cache_dir", settings.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        self.store = open_store(settings.data_dir, sibling=True)
        self.devices = Devices(self.store, settings.checkpoint_interval, settings.checkpoint_max_duty,
                               settings.warmup_timeout, process=(index, self.count))
        self.registry = _ShardRegistry(self.store, self._open_from_store)
        self.ledgers = Ledgers(self.store)
        self.servicer = ClipdServicer(settings, Lifecycle(settings, self.registry, self.devices, self.store,
                                                          self.ledgers),
                                      SubmitTokens(self.store.submit_token_key()))
        self.servicer.prepare_receive_buffers(self.devices)
        limit = settings.max_message_bytes + (1 << 16)
        options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        self._options = options
        if control is None:
            assert private_dir is not None  # (a shard process of --processes: the control's unix socket)
            control = f"unix:{os.path.join(private_dir, 'control.sock')}"
        self.control = peer_channel(settings, control, options)
        self._to_sibling: dict = {}
        if private_dir is not None:
            self.set_siblings({i: f"unix:{socket_path(private_dir, i)}" for i in range(self.count) if i != index})
        workers = settings.max_streams + OTHER_STREAMS + settings.unary_workers
        # The public port and this process's own port: TLS and limits as one process has them. Roles are
        # checked where each call is handled: Submit here, everything else by the control process.
        self.public = grpc.server(concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="clipd-shard"),
                                  options=[*[(k, v) for k, v in server_options(settings) if k != "grpc.so_reuseport"],
                                           ("grpc.so_reuseport", 1)],
                                  interceptors=[Guard("", self.servicer)])
        self._placement: list[str] = []  # every shard process's endpoint, from the control (Serve)
        self._pass_placement = _pass_unary(self.control.unary_unary(f"/{SERVICE.full_name}/GetPlacement"), index)
        self.public.add_generic_rpc_handlers((passing_through(self.control, index, submit=self._submit,
                                                              placement=self._get_placement),))
        self.health = health.HealthServicer()
        self._serving = health_pb2.HealthCheckResponse.SERVING
        for name in ("", SERVICE.full_name):  # until the control process says every shard process is up
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.public)
        enable_reflection((SERVICE.full_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
                          self.public)
        credentials = grpc_server_credentials(settings)
        ports = []
        for port in (public_port, data_port):
            address = f"{settings.host}:{port}"
            ports.append(self.public.add_secure_port(address, credentials) if credentials is not None
                         else self.public.add_insecure_port(address))
        if public_port and ports[0] != public_port:
            raise RuntimeError(f"shard process {index}: bound port {ports[0]}, not {public_port}")
        self.data_port = ports[1]
        self.private = None
        if private_dir is None:
            return
        # The private socket: Submit forwarded by the other shard processes, and the control's calls.
        self.private = grpc.server(concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="clipd-shard-in"),
                                   options=server_options(settings))
        self.private.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler(SERVICE.full_name, {
                "Submit": grpc.stream_stream_rpc_method_handler(self._submit)}),))
        host_grpc.add_ShardHostServicer_to_server(_ShardHostService(self), self.private)
        self.private.add_insecure_port(f"unix:{socket_path(private_dir, index)}")

    def set_siblings(self, targets: dict[int, str]) -> None:
        """Where the other shard processes take the Submit streams this one forwards to them."""
        self._to_sibling = {
            i: _pass(peer_channel(self.settings, t, self._options).stream_stream(f"/{SERVICE.full_name}/Submit"),
                     self.index, streaming_in=True, vouch=self.servicer.auth.client_tokens.vouch)
            for i, t in targets.items()}

    # Opening an aggregation ------------------------------------------------------------------------
    def _open_from_store(self, aggregation_id: str) -> Aggregation:
        """The aggregation as the store has it, with this process's shards claimed and restored."""
        record = self.store.get(aggregation_id)
        if record is None:
            raise NotFound(f"no aggregation {aggregation_id!r}")
        if record.state == FINALIZED:
            raise FailedPrecondition(f"aggregation {aggregation_id} is finalized: it takes no more batches")
        if record.state == FAILED:
            raise FailedPrecondition(f"aggregation {aggregation_id} failed: {record.reason}")
        shards = AggregationSpec.from_json(record.spec).shards
        mine = self.devices.owned(shards)
        # Claim before reading: no earlier owner of these shards can commit after the checkpoints read here.
        epochs = {k: self.store.claim_shard(aggregation_id, k) for k in mine}
        recovered = [self.store.load_checkpoint(aggregation_id, shard=k) if k in epochs else None
                     for k in range(shards)]
        aggregation = Aggregation.from_record(record, self.settings, recovered=recovered)
        aggregation.claimed([epochs.get(k) for k in range(shards)])
        if record.state == CLOSING:  # being finalized: what its checkpoints hold is all it will hold
            aggregation.close()
        elif mine:
            self.devices.warm_up(aggregation)
        return aggregation

    # Submit: here, or on to the process that owns the shard ----------------------------------------
    def _owner(self, message, token: str | None, context) -> int:
        """The process that sums the stream's shard (this one when that can't be known, or the caller may not
        submit: it refuses, as one process does). Read from the store's record once: nothing is opened for
        routing, and a caller who may not submit costs no search for what its token is."""
        if isinstance(message, self._malformed) or not message.aggregation_id:
            return self.index
        record = self.store.get(message.aggregation_id)
        if record is None or not self.servicer.auth.may_submit(token, record.aggregation_id, record_scope(record)):
            return self.index
        client = message.client_id or self.servicer.auth.credential_client_id(token, context) or ""
        return owner_of(wire.shard_of(client, AggregationSpec.from_json(record.spec).shards), self.count)

    def _submit(self, raw_requests, context):
        token = bearer_token(context.invocation_metadata())
        owner_key = stream_owner(token, context)
        waiting = _FirstMessage(raw_requests)
        try:  # a slot while the first message comes (an evictable one), as for any stream
            self.servicer.stream_slots.acquire(owner_key, waiting)
        except ClipdError as e:
            self.servicer.refuse(context, e, "Submit")
        try:
            first = waiting.take(self.settings.stream_idle_timeout)
        finally:
            self.servicer.stream_slots.release(owner_key, waiting)
        if first is _FirstMessage.NOTHING:
            self.servicer.refuse(context, Unavailable(
                f"nothing received for {self.settings.stream_idle_timeout:g} s (or the slot went to another"
                " client): the stream is closed; reconnect to go on"), "Submit")
        if first is None:
            return
        message = self._parse(first)
        owner = self._owner(message, token, context)
        if owner == self.index:
            messages = itertools.chain([message], map(self._parse, raw_requests))
            del message, first
            for response in self.servicer.Submit(messages, context):
                yield response.SerializeToString()
            return
        del message
        forward = self._to_sibling.get(owner)
        if forward is None:  # a Ray host that has not heard of its siblings yet (it just restarted)
            self.servicer.refuse(context, Unavailable(f"shard process {owner} is not reachable yet; retry"), "Submit")
        try:  # a plain client reached the wrong process: one hop to the owner, bytes as they came
            self.servicer.stream_slots.acquire(owner_key)
        except ClipdError as e:
            self.servicer.refuse(context, e, "Submit")
        try:
            yield from forward(itertools.chain([first], raw_requests), context)
        finally:
            self.servicer.stream_slots.release(owner_key)

    # The control process's calls -------------------------------------------------------------------
    def handle(self, name: str, request):
        """One of the control's calls (:data:`CALLS`, the ShardHost service) with its request message: its
        answer message; a refusal raised as ``ClipdError``."""
        return getattr(self, f"_{name.lower()}")(request)

    def _open(self, request: host_pb.OpenRequest) -> host_pb.OpenResponse:
        """Opens the aggregation here and waits (up to the warm-up timeout) for its programs to compile."""
        aggregation = self.registry.get(request.aggregation_id)
        with aggregation.cond:
            aggregation.cond.wait_for(lambda: aggregation.state is not State.WARMING_UP, self.settings.warmup_timeout)
            return host_pb.OpenResponse(state=aggregation.state.value)

    def _finish(self, request: host_pb.FinishRequest) -> host_pb.FinishResponse:
        """No more batches; every accepted one summed; this process's shards' final checkpoints committed."""
        try:
            aggregation = self.registry.get(request.aggregation_id)
        except FailedPrecondition:
            return host_pb.FinishResponse()  # not open here and closing, finalized or failed: nothing in flight
        aggregation.close()
        timeout = request.timeout_seconds
        if not aggregation.wait_drained(timeout):
            raise DeadlineExceeded(f"aggregation {aggregation.id}: {aggregation.pending} accepted batches not"
                                   f" summed after {timeout:g} s")
        if aggregation.state is State.FAILED:
            raise FailedPrecondition(f"aggregation {aggregation.id} failed: {aggregation.failure_reason}")
        self.devices.commit_final(aggregation, timeout)
        return host_pb.FinishResponse(shards=list(self.devices.owned(aggregation.shards)))

    def _stats(self, request: host_pb.StatsRequest) -> host_pb.StatsResponse:
        """Each named open aggregation's statistics, per shard of this process; this process's devices."""
        answer = host_pb.StatsResponse(
            devices=[host_pb.Device(**d) for d in self.devices.describe()], queued_bytes=self.devices.queued_bytes,
            queue_depth=self.devices.queue_depth, payload_bytes=self.servicer.payload_bytes, load=self.load())
        wanted = set(request.aggregation_ids)
        for aggregation in self.registry.all():
            if aggregation.id not in wanted:
                continue
            found = answer.aggregations[aggregation.id]
            for k, state in aggregation.live_shard_totals(self.devices.owned(aggregation.shards)).items():
                found.shards[k].CopyFrom(stats_to_proto(state))
            found.failure_reason = aggregation.failure_reason if aggregation.state is State.FAILED else ""
            found.clients = aggregation.submitted_clients()
        return answer

    def load(self) -> host_pb.Load:
        """This process's Submit streams, buffers and refusals (the control sums them with its own)."""
        slots, budget = self.servicer.stream_slots, self.servicer.budget
        return host_pb.Load(active_streams=slots.active, stream_limit=slots.limit, refused_streams=slots.refused,
                            buffered_bytes=budget.used, buffer_limit=budget.limit, refused_batches=budget.refused,
                            rejections=dict(self.servicer.rejections),
                            participation_refusals=dict(self.ledgers.participation_refusals))

    def _forget(self, request: host_pb.ForgetRequest) -> host_pb.ForgetResponse:
        with contextlib.suppress(NotFound):
            aggregation = Registry.get(self.registry, request.aggregation_id)  # not opened here: nothing to forget
            self.registry.remove(aggregation.id)
            aggregation.cancel()
            self.devices.forget(aggregation)
        self.servicer.budget.drop_pool()
        return host_pb.ForgetResponse()

    def _serve(self, request: host_pb.ServeRequest) -> host_pb.ServeResponse:
        """Says SERVING; ``endpoints``: every shard process's, for GetPlacement (sent again when one moved)."""
        self.set_placement(list(request.endpoints))
        for name in ("", SERVICE.full_name):
            self.health.set(name, self._serving)
        return host_pb.ServeResponse()

    def set_placement(self, endpoints: list[str]) -> None:
        """Where shard process *i* is reached (endpoint *i*); an empty or partial list: GetPlacement is
        passed through to the control, which always knows."""
        self._placement = list(endpoints) if len(endpoints) == self.count and all(endpoints) else []

    def _get_placement(self, request: bytes, context) -> bytes:
        """GetPlacement answered here, from the store's record and the endpoints the control sent: a round of
        thousands of clients asks it once each, and a call passed through to the control would hold one of
        this process's threads for as long as the control takes (they would be Submit's)."""
        endpoints = self._placement
        if not endpoints:
            return self._pass_placement(request, context)
        try:
            message = clipd_pb2.GetPlacementRequest.FromString(request)
        except Exception:  # noqa: BLE001 (protobuf's DecodeError): as gRPC's own deserializer refuses it
            context.abort(grpc.StatusCode.INTERNAL, "Exception deserializing request!")
        try:
            token = bearer_token(context.invocation_metadata())
            self.servicer.auth.authorize(token, message.aggregation_id, "submit to")
            record = self.store.get(message.aggregation_id)
            if record is None:
                raise NotFound(f"no aggregation {message.aggregation_id!r}")
        except ClipdError as e:
            self.servicer.refuse(context, e, "GetPlacement")
            raise  # (refuse aborts the call)
        shards = AggregationSpec.from_json(record.spec).shards
        placement = clipd_pb2.Placement(aggregation_id=record.aggregation_id, shards=shards,
                                        endpoints=[endpoints[owner_of(k, self.count)] for k in range(shards)])
        return placement.SerializeToString()

    # Running -------------------------------------------------------------------------------------
    def start(self) -> ShardProcess:
        if self.private is not None:
            self.private.start()
        self.public.start()
        if not self.devices.wait_ready(self.settings.warmup_timeout):
            raise RuntimeError(f"shard process {self.index}: its devices did not run a first program")
        return self

    def stop(self, grace: float) -> None:
        self.health.enter_graceful_shutdown()
        self.public.stop(grace).wait(grace + 1.0)
        if self.private is not None:
            self.private.stop(0)
        self.devices.stop(timeout=grace)
        self.store.close()


def socket_path(private_dir: str, index: int) -> str:
    return os.path.join(private_dir, f"shard-{index}.sock")


def main() -> None:
    """A shard process (``python -m clipd.server.shards.process``, started by the control process).

    Reads its orders as one JSON line on stdin, answers ``ready <its own port>`` on stdout once it
    listens, and serves until SIGTERM, or until the control process (its parent) is gone.
    """
    orders = json.loads(sys.stdin.readline())
    settings = Settings(**orders["settings"])
    from clipd.server import logs

    logs.configure(settings.log_level, settings.log_format)
    parent = os.getppid()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the control stops us
    process = ShardProcess(settings, orders["index"], orders["port"], orders["data_port"],
                           orders["private_dir"]).start()
    print(f"ready {process.data_port}", flush=True)
    while not done.wait(0.5):
        if os.getppid() != parent:  # the control process died (SIGKILL): a new one starts new shard processes
            break
    process.stop(settings.shutdown_grace if done.is_set() else 0.0)
    os._exit(0)


# The control process's side -------------------------------------------------------------------------
def _gpu_count() -> int:
    return sum(1 for name in os.listdir("/dev") if name.startswith("nvidia") and name[6:].isdigit()) \
        if os.path.isdir("/dev") else 0


def child_environment(index: int, processes: int, environ=os.environ) -> dict[str, str]:
    """A shard process's environment: its GPU (one each when there are enough), its share of GPU memory.

    >>> env = child_environment(1, 4, {})
    >>> env["XLA_PYTHON_CLIENT_PREALLOCATE"], env["XLA_PYTHON_CLIENT_MEM_FRACTION"]
    ('false', '0.225')
    """
    env = dict(environ)
    gpus = _gpu_count()
    if gpus >= processes and "CUDA_VISIBLE_DEVICES" not in environ:
        env["CUDA_VISIBLE_DEVICES"] = str(index % gpus)
    sharing = processes if gpus < processes else 1  # processes on one GPU
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / sharing:.3f}")
    return env


class ShardProcesses:
    """The control process's shards: N shard processes, started, watched and restarted; the calls that span them.

    It has the calls of :class:`~clipd.server.shards.local.Devices` that the servicer uses, so the servicer is the
    same in every mode.
    """

    def __init__(self, settings: Settings, store: Store, port: int) -> None:
        self.settings, self.store, self.port = settings, store, port
        self.count = settings.processes
        self.private_dir = tempfile.mkdtemp(prefix="clipd-shards-")  # 0700: the sockets are private
        self.data_ports = [settings.shard_ports + i if settings.shard_ports else 0 for i in range(self.count)]
        self._processes: list[subprocess.Popen | None] = [None] * self.count
        self._served = [False] * self.count
        self._told: list[str] = []  # the endpoints the serving shard processes answer GetPlacement with
        self.restarts = [0] * self.count
        self._channels = [grpc.insecure_channel(f"unix:{socket_path(self.private_dir, i)}") for i in range(self.count)]
        self._hosts = [host_grpc.ShardHostStub(channel) for channel in self._channels]
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._started = False
        self.registry: Registry | None = None
        self._seen: dict[int, host_pb.StatsResponse] = {}  # the last Stats answer of each process
        self._empty: dict[str, PartialState] = {}
        self._fenced: set[str] = set()  # aggregations whose shards this control claimed at finalize
        self._threads = [threading.Thread(target=self._watch, name="clipd-shards-watch", daemon=True),
                         threading.Thread(target=self._pump, name="clipd-shards-stats", daemon=True)]

    def __len__(self) -> int:
        return self.count

    # Starting and watching -----------------------------------------------------------------------------
    def _spawn(self, index: int, timeout: float = 120.0) -> bool:
        """A new interpreter (not a fork: this process has gRPC and JAX threads); True once it is ready."""
        process = subprocess.Popen([sys.executable, "-m", "clipd.server.shards.process"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=child_environment(index, self.count))
        orders = {"settings": dataclasses.asdict(self.settings), "port": self.port, "index": index,
                  "data_port": self.data_ports[index], "private_dir": self.private_dir}
        stdin, stdout = process.stdin, process.stdout
        assert stdin is not None and stdout is not None  # (PIPE both)
        with contextlib.suppress(OSError):
            stdin.write(json.dumps(orders) + "\n")
            stdin.close()
        answer: list[str] = []
        reader = threading.Thread(target=lambda: answer.append(stdout.readline()), name="clipd-shard-ready",
                                  daemon=True)
        reader.start()
        reader.join(timeout)
        failed = not answer or not answer[0].startswith("ready ")
        with self._lock:
            self._processes[index] = process
            stopping = self._stopping.is_set()
            if failed and not stopping:
                self.restarts[index] += 1  # a start-up retry is a restart too
        if stopping or failed:
            with contextlib.suppress(OSError):
                process.kill()
            process.wait()
            log.warning("shard process %d did not start (exit status %s); trying again", index, process.returncode,
                        extra={"event": "shard_process.start_failed"})
            if self.data_ports[index] and not self.settings.shard_ports:
                self.data_ports[index] = 0  # its old port may be taken: any free one (clients ask again)
            return False
        stdout.close()
        self.data_ports[index] = int(answer[0].split()[1])
        return True

    def _bring_up(self, index: int, serve: bool = True) -> None:
        """Starts process ``index`` until one is ready (or the server stops); ``serve``: then lets it serve."""
        while not self._stopping.is_set():
            if self._spawn(index) and (not serve or self._serve(index)):
                return
            self._stopping.wait(0.5)

    def _serve(self, index: int) -> bool:
        """Process ``index`` says SERVING on its health service (once every process is up).

        One that can't be told is killed (never two live owners of the same shards): it starts again.
        """
        endpoints = self.endpoints()  # what its GetPlacement answers
        try:
            self._hosts[index].Serve(host_pb.ServeRequest(endpoints=endpoints), timeout=30, wait_for_ready=True)
            told = True
        except grpc.RpcError:
            told = False
        with self._lock:
            process = self._processes[index]
            if told and process is not None and process.poll() is None:
                self._served[index] = True
                others = [i for i in range(self.count) if i != index and self._served[i]]
            else:
                others = None
        if others is not None:
            if endpoints != self._told:  # it came back on another port: the others answer GetPlacement too
                for other in others:
                    with contextlib.suppress(grpc.RpcError):
                        self._hosts[other].Serve(host_pb.ServeRequest(endpoints=endpoints), timeout=5)
                self._told = endpoints
            return True
        if process is not None:
            with contextlib.suppress(OSError):
                process.kill()
            process.wait()
        with self._lock:
            self.restarts[index] += 1  # it starts again
        return False

    def start(self, registry: Registry) -> ShardProcesses:
        """Starts every shard process and returns once each is ready (one that dies meanwhile starts again)."""
        self.registry = registry
        while not self._stopping.is_set():
            down = [i for i in range(self.count) if not self._served[i]]
            if not down:
                break
            threads = [threading.Thread(target=self._bring_up, args=(i, False), name="clipd-shard-start", daemon=True)
                       for i in down]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            for index in down:  # every one is up: they serve (one that died meanwhile starts again above)
                self._serve(index)
        self._started = True
        for thread in self._threads:
            thread.start()
        return self

    def _watch(self) -> None:
        """Restarts a shard process that exits (on a thread of its own: the others go on serving)."""
        while not self._stopping.wait(0.2):
            for index in range(self.count):
                with self._lock:
                    process = self._processes[index]
                    dead = self._served[index] and process is not None and process.poll() is not None
                    if dead:
                        self._served[index] = False
                        self.restarts[index] += 1
                if dead and process is not None and not self._stopping.is_set():
                    log.warning("shard process %d (pid %d) exited with %s; starting another", index, process.pid,
                                process.returncode, extra={"event": "shard_process.restarted"})
                    threading.Thread(target=self._bring_up, args=(index,), name="clipd-shard-start",
                                     daemon=True).start()

    def _call(self, index: int, name: str, request, timeout: float, quiet: bool = False):
        """One of the control's calls (:data:`CALLS`) to host ``index``: its answer message; None if it failed
        (``quiet``), else its error raised (:func:`host_error`)."""
        try:
            return self._transport(index, name, request, timeout)
        except ClipdError:
            if quiet:
                return None
            raise

    def _transport(self, index: int, name: str, request, timeout: float):
        try:
            return getattr(self._hosts[index], name)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise host_error(f"shard process {index}", e.code(), e.details()) from None

    # The servicer's calls --------------------------------------------------------------------------------
    def warm_up(self, aggregation: Aggregation) -> None:
        """Every shard process opens the aggregation (compiles its programs); it is OPEN once they all have."""
        if not self._started:  # recovery, before the shard processes start: they open it when first asked
            aggregation.mark_open()
            return

        def open_everywhere():
            for index in range(min(self.count, aggregation.shards)):
                self._call(index, "Open", host_pb.OpenRequest(aggregation_id=aggregation.id),
                           timeout=self.settings.warmup_timeout, quiet=True)
            aggregation.mark_open()

        threading.Thread(target=open_everywhere, name=f"clipd-open-{aggregation.id}", daemon=True).start()

    def submit(self, aggregation, client: str, writer: str, batch) -> None:
        raise Unavailable("the control process sums nothing: Submit goes to the shard processes")

    def commit_final(self, aggregation: Aggregation, timeout: float | None = None) -> list[PartialState]:
        """Closes the aggregation in every shard process, fences them out and reads back every final checkpoint."""
        deadline = time.monotonic() + (timeout if timeout is not None else 3600.0)
        if aggregation.id not in self._fenced:  # a retry after the fence reads the checkpoints again
            self.store.set_state(aggregation.id, CLOSING)
            owners = sorted({owner_of(k, self.count) for k in range(aggregation.shards)})
            with concurrent.futures.ThreadPoolExecutor(len(owners), thread_name_prefix="clipd-finish") as pool:
                try:
                    for finished in [pool.submit(self._finish, i, aggregation, deadline) for i in owners]:
                        finished.result()
                except FailedPrecondition as e:  # a shard process failed it: so does the aggregation
                    fail(aggregation, self.store, str(e))
                    raise
            for k in range(aggregation.shards):  # from here on, no shard process's checkpoint can land
                self.store.claim_shard(aggregation.id, k)
            self._fenced.add(aggregation.id)
        totals = [self.store.load_checkpoint(aggregation.id, shard=k, newest_only=True)
                  for k in range(aggregation.shards)]
        read = [t for t in totals if t is not None]
        if len(read) < len(totals):
            missing = totals.index(None)
            raise FailedPrecondition(f"aggregation {aggregation.id}: the final checkpoint of shard {missing}"
                                     " can't be read back")
        return read

    def _finish(self, index: int, aggregation: Aggregation, deadline: float) -> None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"aggregation {aggregation.id}: shard process {index} did not commit its"
                                       " final checkpoints in time")
            try:
                self._call(index, "Finish", host_pb.FinishRequest(aggregation_id=aggregation.id, timeout_seconds=left),
                           timeout=left + 1.0)
                return
            except Unavailable:
                time.sleep(0.1)  # restarting: it opens the aggregation from the store again

    def forget(self, aggregation: Aggregation) -> None:
        for index in range(self.count):
            self._call(index, "Forget", host_pb.ForgetRequest(aggregation_id=aggregation.id), timeout=10.0, quiet=True)
        self._empty.pop(aggregation.id, None)
        self._fenced.discard(aggregation.id)

    def finished(self, aggregation: Aggregation) -> None:
        """Finalized (the store says so): the shard processes drop their copies (a late Submit is refused)."""
        threading.Thread(target=self.forget, args=(aggregation,), name="clipd-forget", daemon=True).start()

    def endpoints(self) -> list[str]:
        host = self.settings.advertise_host or self.settings.host
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return [f"{host}:{port}" for port in self.data_ports]

    # Statistics: polled from the shard processes ----------------------------------------------------------
    def _pump(self, period: float = 0.5) -> None:
        while not self._stopping.wait(period):
            with contextlib.suppress(Exception):
                self.poll()

    def poll(self) -> None:
        """Reads every shard process's statistics of the open aggregations into the control's aggregations."""
        if self.registry is None:  # not started
            return
        live = [a for a in self.registry.all() if a.state in (*TAKES_BATCHES, State.FINALIZING)]
        ids = [a.id for a in live]
        answers = {}
        for index in range(self.count):
            answer = self._call(index, "Stats", host_pb.StatsRequest(aggregation_ids=ids), timeout=5.0, quiet=True)
            if answer is not None:
                answers[index] = self._seen[index] = answer
        for aggregation in live:
            empty = self._empty.get(aggregation.id)
            if empty is None:
                empty = self._empty[aggregation.id] = PartialState.empty(aggregation.layers)
            states, failed, clients = {}, "", 0
            for answer in answers.values():
                if aggregation.id in answer.aggregations:
                    found = answer.aggregations[aggregation.id]
                    states.update({k: stats_from_proto(empty, v) for k, v in found.shards.items()})
                    failed = failed or found.failure_reason
                    clients += found.clients
            if failed and aggregation.state in TAKES_BATCHES:
                fail(aggregation, self.store, failed)
            elif states:
                aggregation.observe(states, clients)

    @property
    def payload_bytes(self) -> int:
        """Submit payload bytes the shard processes received (as of their last statistics)."""
        return sum(a.payload_bytes for a in self._seen.values())

    def loads(self) -> dict[int, host_pb.Load]:
        """Each shard process's streams, buffers and refusals, as of its last statistics (absent until then)."""
        return {index: answer.load for index, answer in self._seen.items()}

    # The server ----------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        with self._lock:
            return self._started and all(self._served)

    @property
    def queued_bytes(self) -> int:
        return sum(a.queued_bytes for a in self._seen.values())

    @property
    def queue_depth(self) -> int:
        return sum(a.queue_depth for a in self._seen.values())

    @property
    def device_kind(self) -> str:
        devices = self.describe()
        return devices[0]["kind"] if devices else "shard processes"

    def describe(self) -> list[dict]:
        """Every shard process's devices (as of its last statistics), with the process's index."""
        return [{"id": d.id, "kind": d.kind, "platform": d.platform, "steps": d.steps, "process": i}
                for i, a in sorted(self._seen.items()) for d in a.devices]

    def describe_processes(self) -> list[dict]:
        with self._lock:
            return [{"index": i, "pid": p.pid if p else None, "alive": bool(p and p.poll() is None),
                     "serving": self._served[i], "restarts": self.restarts[i], "endpoint": e,
                     "payload_bytes": self._seen[i].payload_bytes if i in self._seen else None}
                    for i, (p, e) in enumerate(zip(self._processes, self.endpoints()))]

    def stop(self, timeout: float | None = None) -> None:
        grace = 10.0 if timeout is None else timeout
        self._stopping.set()
        with self._lock:
            processes = [p for p in self._processes if p is not None]
        for process in processes:
            if process.poll() is None:
                process.terminate()  # SIGTERM: it stops its gRPC ports with ``grace``, commits, exits
        deadline = time.monotonic() + grace + 2.0
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for channel in self._channels:
            channel.close()
        import shutil

        shutil.rmtree(self.private_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
