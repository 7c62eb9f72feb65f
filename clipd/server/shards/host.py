"""A shard host: one of the processes that sum (``clipd serve --processes N``, or a Ray actor of ``--ray``).
The process that receives a batch clips and sums it.

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
sees a payload byte (but a buffered stream's: ``shards/routed.py``): it creates
aggregations in the store, reads the shard processes' statistics (polled twice a second), finalizes (below), releases
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

import contextlib
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time

import grpc

from clipd import wire
from clipd.server.aggregations import Aggregation, AggregationSpec, Registry, State, buffer_refusal
from clipd.server.credentials import bearer_token
from clipd.server.errors import ClipdError, DeadlineExceeded, FailedPrecondition, NotFound, Unavailable
from clipd.server.internal.v1 import shard_host_pb2 as host_pb
from clipd.server.internal.v1 import shard_host_pb2_grpc as host_grpc
from clipd.server.rpc.limits import ServerPool, on_pool
from clipd.server.rpc.submit import stream_owner
from clipd.server.settings import Settings
from clipd.server.shards.forward import _pass, _pass_unary, passing_through
from clipd.server.shards.protocol import SERVICE, stats_to_proto
from clipd.server.stores.base import CLOSING, FAILED, FINALIZED
from clipd.server.summing.devices import owner_of
from clipd.server.summing.memory import HeapTrimmer
from clipd.server.tls import peer_channel
from clipd.v1 import clipd_pb2


class _ShardHostService(host_grpc.ShardHostServicer):
    """The ShardHost service on a shard process's private socket: each call runs on the process; a
    ``ClipdError`` it raises is the call's status."""

    def __init__(self, process: ShardHost) -> None:
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

    def identities(self) -> list[tuple[str, float]]:
        return [(r.aggregation_id, r.created) for r in self._store.records()]

    def scope(self, aggregation_id: str) -> tuple[float, str | None] | None:
        """From the store's record, as :meth:`created`."""
        scope = super().scope(aggregation_id)
        if scope is None:
            record = self._store.get(aggregation_id)
            scope = None if record is None else record_scope(record)
        return scope


class ShardHost:
    """One shard process: its own gRPC ports, device workers and partial states; see the module doc."""

    def __init__(self, settings: Settings, index: int, public_port: int, data_port: int, private_dir: str | None,
                 control: str | None = None) -> None:
        """``private_dir``: the unix sockets of ``--processes``; None on Ray
        (:class:`clipd.server.shards.ray_hosts.ShardHost`):
        ``control`` is then the server's address, the siblings' are set by :meth:`set_siblings` and the
        control's calls are the actor's methods."""
        from clipd.server.rpc.codec import Malformed, lenient
        from clipd.server.rpc.server import OTHER_STREAMS, server_options
        from clipd.server.rpc.serving import listen, serving_process
        from clipd.server.stores import open_store
        from clipd.server.summing.devices import Devices

        self.settings, self.index, self.count = settings, index, settings.processes
        self.private_dir = private_dir
        self._malformed, self._parse = Malformed, lenient(wire.parse_submit_request)
        limit = settings.max_message_bytes + (1 << 16)
        options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        self._options = options
        if control is None:
            assert private_dir is not None  # (a shard process of --processes: the control's unix socket)
            control = f"unix:{os.path.join(private_dir, 'control.sock')}"
        self.control = peer_channel(settings, control, options)
        self._placement: list[str] = []  # every shard process's endpoint, from the control (Serve)
        self._pass_placement = _pass_unary(self.control.unary_unary(f"/{SERVICE.full_name}/GetPlacement"), index)
        store = open_store(settings.data_dir, sibling=True)
        # The public port and this process's own port: TLS and limits as one process has them. Roles are
        # checked where each call is handled: Submit here, everything else by the control process.
        self.serving = serving_process(
            settings, store, _ShardRegistry(store, self._open_from_store),
            lambda: Devices(store, settings.checkpoint_interval, settings.checkpoint_max_duty, settings.warmup_timeout,
                            process=(index, self.count),
                            busy_checkpoint_interval=settings.busy_checkpoint_interval), admin_token="",
            handlers=lambda servicer: [passing_through(self.control, index, submit=self._submit,
                                                       placement=self._get_placement,
                                                       submit_one=on_pool(self._submit_one,
                                                                          servicer.admission.pool))],
            role="shard", options=[*[(k, v) for k, v in server_options(settings)
                                                if k != "grpc.so_reuseport"], ("grpc.so_reuseport", 1)])
        self.serving.set_serving(False)  # until the control process says every shard process is up
        self.store, self.registry, self.ledgers = store, self.serving.registry, self.serving.ledgers
        self.devices: Devices = self.serving.shards  # type: ignore[assignment]  # (the Devices made above)
        self.servicer, self.public = self.serving.servicer, self.serving.grpc
        self.servicer.attach_devices(self.devices)
        self._trimmer = HeapTrimmer(self.servicer.budget)
        self._to_sibling: dict = {}
        self._one_to_sibling: dict = {}
        if private_dir is not None:
            self.set_siblings({i: f"unix:{socket_path(private_dir, i)}" for i in range(self.count) if i != index})
        # (Its own port is bound with SO_REUSEPORT too, the server's option: a port 0 would then let the kernel hand
        # out one that a shard process of a control that just died still holds. A free one is picked first.)
        ports = [listen(self.public, settings, port) for port in (public_port, data_port or _free_port(settings.host))]
        if public_port and ports[0] != public_port:
            raise RuntimeError(f"shard process {index}: bound port {ports[0]}, not {public_port}")
        self.data_port = ports[1]
        self.private = None
        if private_dir is None:
            return
        # The private socket: Submit forwarded by the other shard processes, and the control's calls.
        workers = settings.max_streams + OTHER_STREAMS + settings.unary_workers
        self.private = grpc.server(ServerPool(workers, thread_name_prefix="clipd-shard-in"),
                                   options=server_options(settings))
        self.private.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler(SERVICE.full_name, {
                "Submit": grpc.stream_stream_rpc_method_handler(self._submit),
                "SubmitOne": grpc.unary_unary_rpc_method_handler(
                    on_pool(self._submit_one, self.servicer.admission.pool))}),))
        host_grpc.add_ShardHostServicer_to_server(_ShardHostService(self), self.private)
        self.private.add_insecure_port(f"unix:{socket_path(private_dir, index)}")

    def set_siblings(self, targets: dict[int, str]) -> None:
        """Where the other shard processes take the Submit streams this one forwards to them."""
        vouch = self.servicer.auth.client_tokens.vouch
        channels = {i: peer_channel(self.settings, t, self._options) for i, t in targets.items()}
        self._to_sibling = {
            i: _pass(channel.stream_stream(f"/{SERVICE.full_name}/Submit"), self.index, streaming_in=True, vouch=vouch)
            for i, channel in channels.items()}
        self._one_to_sibling = {i: _pass_unary(channel.unary_unary(wire.SUBMIT_ONE_METHOD), self.index, vouch=vouch)
                                for i, channel in channels.items()}

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
        spec = AggregationSpec.from_json(record.spec)
        if spec.stream:  # summed by the control process (shards/routed.py): never claimed here
            raise FailedPrecondition(buffer_refusal(aggregation_id, spec.stream, spec.version))
        shards = spec.shards
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
        submit: it refuses, as one process does). From the aggregation if it is open here, else from the store's
        record: nothing is opened for routing, and a caller who may not submit costs no search for what its
        token is."""
        if isinstance(message, self._malformed) or not message.aggregation_id:
            return self.index
        aggregation_id = message.aggregation_id
        try:  # open here: no store read (a one-message round asks once a client)
            aggregation = Registry.get(self.registry, aggregation_id)
            shards, scope = aggregation.shards, aggregation.scope
        except NotFound:
            record = self.store.get(aggregation_id)
            if record is None:
                return self.index
            scope, shards = record_scope(record), AggregationSpec.from_json(record.spec).shards
        if not self.servicer.auth.may_submit(token, aggregation_id, scope):
            return self.index
        client = message.client_id or self.servicer.auth.credential_client_id(token, context) or ""
        return owner_of(wire.shard_of(client, shards), self.count)

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

    def _submit_one(self, raw: bytes, context) -> bytes:
        """SubmitOne: summed here if this process owns the client's shard, else passed on to the one that does
        (one hop over the private socket, bytes as they came)."""
        token = bearer_token(context.invocation_metadata())
        message = self._parse(raw)
        owner = self._owner(message, token, context)
        if owner == self.index:
            del raw
            return self.servicer.SubmitOne(message, context).SerializeToString()
        del message
        forward = self._one_to_sibling.get(owner)
        if forward is None:  # a Ray host that has not heard of its siblings yet (it just restarted)
            self.servicer.refuse(context, Unavailable(f"shard process {owner} is not reachable yet; retry"),
                                 "SubmitOne")
            raise AssertionError("refuse aborts the call")
        return forward(raw, context)

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
        return self.servicer.load(self.ledgers.participation_refusals)

    def _forget(self, request: host_pb.ForgetRequest) -> host_pb.ForgetResponse:
        with contextlib.suppress(NotFound):
            aggregation = Registry.get(self.registry, request.aggregation_id)  # not opened here: nothing to forget
            self.registry.remove(aggregation.id)
            aggregation.cancel()
            self.devices.forget(aggregation)
        self.servicer.budget.fit_pool()  # what fits waits for the next round (pool_idle)
        return host_pb.ForgetResponse()

    def _serve(self, request: host_pb.ServeRequest) -> host_pb.ServeResponse:
        """Says SERVING; ``endpoints``: every shard process's, for GetPlacement (sent again when one moved)."""
        self.set_placement(list(request.endpoints))
        self.serving.set_serving(True)
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
    def start(self) -> ShardHost:
        if self.private is not None:
            self.private.start()
        self.public.start()
        if not self.devices.wait_ready(self.settings.warmup_timeout):
            raise RuntimeError(f"shard process {self.index}: its devices did not run a first program")
        self._trimmer.start()  # (its own heap: what a flood of abandoned batches left here goes back too)
        return self

    def stop(self, grace: float) -> None:
        self._trimmer.stop()
        self.serving.health.enter_graceful_shutdown()
        self.public.stop(grace).wait(grace + 1.0)
        if self.private is not None:
            self.private.stop(0)
        self.devices.stop(timeout=grace)
        self.store.close()


def _free_port(host: str) -> int:
    """A port no socket holds now (bound without SO_REUSEPORT, then let go)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host.strip("[]"), 0))
        return probe.getsockname()[1]


def socket_path(private_dir: str, index: int) -> str:
    return os.path.join(private_dir, f"shard-{index}.sock")


def main() -> None:
    """A shard process (``python -m clipd.server.shards.host``, started by the control process).

    Reads its orders as one JSON line on stdin, answers ``ready <its own port>`` on stdout once it
    listens, and serves until SIGTERM, or until the control process (its parent) is gone.
    """
    orders = json.loads(sys.stdin.readline())
    settings = Settings(**orders["settings"])
    from clipd import _process
    from clipd.server import logs

    _process.name_threads()  # (as clipd serve's: top -H shows which thread is busy)

    logs.configure(settings.log_level, settings.log_format)
    parent = os.getppid()
    stop: list[bool] = []  # (a flag the handler appends to: it takes no lock, see clipd.server.app.serve)
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the control stops us
    process = ShardHost(settings, orders["index"], orders["port"], orders["data_port"],
                        orders["private_dir"]).start()
    print(f"ready {process.data_port}", flush=True)
    _process.settle()  # (as clipd serve's: start-up's objects out of the garbage collector's scans; once ready)
    while not stop:
        if os.getppid() != parent:  # the control process died (SIGKILL): a new one starts new shard processes
            break
        time.sleep(0.5)
    process.stop(settings.shutdown_grace if stop else 0.0)
    os._exit(0)


if __name__ == "__main__":
    main()
