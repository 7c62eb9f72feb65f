"""An aggregation on the host: its spec, its state machine, its totals and statistics; the registry.

Its clients' sequence numbers are kept by :class:`clipd.server.sequences.ClientSequences`.

The device state (the accumulator's delta since the last flush) belongs to the
worker. Everything here is written by the aggregation's own methods: under its
condition variable, but for the adds into a shard's totals, which the one device
worker of that shard makes through ``add_example`` and ``absorb`` (in place,
outside the lock: see ``shard_state``). The servicer and the admin API read it
without touching the device.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from clipd.engine import RATIO_BUCKETS, ClipAccumulator, ClipPolicy, LayerSpec, PartialState, Unit, add_example
from clipd.engine import _privacy as dp
from clipd.engine._audit import CanaryAudit
from clipd.engine._correlated import CorrelatedNoise
from clipd.server.errors import FailedPrecondition, NotFound, ResourceExhausted
from clipd.server.progress import Counts, Progress
from clipd.server.sequences import ClientSequences
from clipd.server.settings import DELTA_BYTES_PER_PARAMETER, TOTALS_BYTES_PER_PARAMETER
from clipd.server.stores.base import AggregationRecord
from clipd.wire import shard_of

CREDENTIAL = "credential"  # client ids come from credentials: client tokens, client certificates, trusted submitters
SELF_ASSERTED = "self_asserted"  # any name the submitter chooses (opted in at creation, or a server without auth)


class State(str, enum.Enum):
    WARMING_UP = "warming_up"
    OPEN = "open"
    FINALIZING = "finalizing"
    FINALIZED = "finalized"
    CANCELLED = "cancelled"
    FAILED = "failed"


TAKES_BATCHES = (State.WARMING_UP, State.OPEN)
ENDED = (State.FINALIZED, State.CANCELLED, State.FAILED)

# The moves an aggregation's state may make (anything else is a bug: InvalidTransition). A recovered aggregation
# starts WARMING_UP and may be restored FINALIZED or FAILED at once; a finished one is cancelled to delete it.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.WARMING_UP: frozenset({State.OPEN, State.FINALIZING, State.FINALIZED, State.FAILED, State.CANCELLED}),
    State.OPEN: frozenset({State.FINALIZING, State.FAILED, State.CANCELLED}),
    State.FINALIZING: frozenset({State.FINALIZED, State.FAILED, State.CANCELLED}),
    State.FINALIZED: frozenset({State.CANCELLED}),
    State.FAILED: frozenset({State.CANCELLED}),
    State.CANCELLED: frozenset(),
}


class InvalidTransition(RuntimeError):
    """An aggregation was asked to move between two states that :data:`TRANSITIONS` does not join."""


@dataclasses.dataclass(frozen=True)
class LayerStats:
    name: str
    bound: float
    clipped: int
    norm_mean: float
    norm_max: float
    norm_histogram: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Stats:
    """A consistent snapshot of one aggregation's counters (host numbers only)."""

    aggregation_id: str
    state: State
    examples: int
    batches: int
    bytes: int
    non_finite: int
    clipped: int  # GLOBAL: examples scaled down; per-layer: layers scaled down, summed
    layers: tuple[LayerStats, ...]
    bucket_upper_bounds: tuple[float, ...]
    example_norm_histogram: tuple[int, ...]
    example_bound: float
    updated_unix_seconds: float
    examples_per_second: float
    failure_reason: str = ""
    privacy_notice: str = ""  # under a privacy policy: why the numbers are withheld, or that they are raw
    release: dict | None = None  # under a privacy policy, once released: the proto Release's fields
    clients: int = 0  # distinct clients with batches in it (spread streams of one client count once)


@dataclasses.dataclass(frozen=True)
class Result:
    stats: Stats
    sums: tuple[np.ndarray, ...]


class SpareTotals:
    """The float64 sums of the last large aggregation that finished in this process, kept for the next round of
    a job on the same layers: its totals then reuse these pages (zeroed in place as it warms up, ``prefault``)
    instead of faulting in fresh ones, which costs the kernel a zeroing pass over gigabytes.

    Kept from the finalize until the next aggregation is created (taken if its layers are the same, freed
    otherwise) or for ``idle`` seconds; the registry counts them in the memory it holds meanwhile.

    >>> spare = SpareTotals(min_bytes=0)
    >>> spare.keep([np.ones(3), np.ones((2, 2))]); spare.nbytes
    56
    >>> [t.shape for t in spare.take([(3,), (2, 2)])], spare.nbytes, spare.take([(3,), (2, 2)])
    ([(3,), (2, 2)], 0, None)
    """

    def __init__(self, min_bytes: int = 64 << 20, idle: float = 120.0) -> None:
        self.min_bytes, self.idle = min_bytes, idle
        self._kept: tuple[list[np.ndarray], float] | None = None
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._fresh_locked()

    def _fresh_locked(self) -> int:
        if self._kept is not None and time.monotonic() - self._kept[1] > self.idle:
            self._kept = None  # not reused in time: freed
        return 0 if self._kept is None else sum(a.nbytes for a in self._kept[0])

    def keep(self, sums) -> None:
        """Keeps ``sums`` (a finished aggregation's float64 totals, no longer used) if they are large."""
        sums = list(sums)
        if sum(a.nbytes for a in sums) >= self.min_bytes:
            with self._lock:
                self._kept = (sums, time.monotonic())

    def take(self, shapes) -> list[np.ndarray] | None:
        """The kept sums if they have these shapes (not zeroed: ``Aggregation.prefault`` does); None otherwise.
        Either way nothing is kept afterwards."""
        with self._lock:
            self._fresh_locked()
            kept, self._kept = self._kept, None
        if kept is None or [a.shape for a in kept[0]] != [tuple(shape) for shape in shapes]:
            return None
        return kept[0]


SPARE_TOTALS = SpareTotals()  # this process's (one registry a process)


def buffer_refusal(aggregation_id: str, stream: str, version: int) -> str:
    """Why a buffered stream's buffer refuses what an aggregation's caller may do (submit, finalize, cancel,
    draw clients): the stream does it."""
    return (f"aggregation {aggregation_id!r} is the buffer of version {version} of stream {stream!r}: its"
            " contributions go through SubmitToStream, and the stream releases it (StopStream stops the stream)")


def refuse_buffer(aggregation: Aggregation) -> Aggregation:
    """``aggregation``, unless it is a buffered stream's buffer (FAILED_PRECONDITION: :func:`buffer_refusal`)."""
    if aggregation.spec.stream:
        raise FailedPrecondition(buffer_refusal(aggregation.id, aggregation.spec.stream, aggregation.spec.version))
    return aggregation


def make_accumulator(layers: tuple[LayerSpec, ...], policy: ClipPolicy, plan) -> ClipAccumulator:
    """An aggregation's accumulator: under secure noise, in fixed point on its release's grid (``plan.grid_step``).
    One for each kind (an accumulator is its configuration: the state is the caller's), made once: a stream's
    buffers and a job's rounds are aggregations of the same kind, one after another."""
    return _accumulator(tuple(layers), policy, plan.grid_step if plan is not None else 0.0)


@functools.lru_cache(maxsize=64)
def _accumulator(layers: tuple[LayerSpec, ...], policy: ClipPolicy, fixed_point_step: float) -> ClipAccumulator:
    return ClipAccumulator(layers, policy, fixed_point_step=fixed_point_step)


@dataclasses.dataclass(frozen=True)
class AggregationSpec:
    """What an aggregation is, fixed when it is created: its layers, its clipping policy, whether a batch
    holding NaN or inf is refused whole (the wire's ``REJECT``; the engine then zeroes nothing), its privacy
    policy, how many shards its clients are split over, its privacy unit (``Unit``: an example, or a client
    identity that contributes once) and how its client ids are established where they count (``client_ids``:
    ``CREDENTIAL``, ``SELF_ASSERTED``, or ``""`` where no identity is counted); a buffered stream's buffer says
    whose and which version it becomes (``stream``, ``version``: its batches then carry weights).
    :meth:`to_json` is the one form it is kept in (``AggregationRecord.spec``); :meth:`Aggregation.from_record`
    opens an aggregation from it.

    >>> spec = AggregationSpec((LayerSpec("w", (2, 3)),), ClipPolicy(l2_norm_clip=1.5), shards=2)
    >>> AggregationSpec.from_json(spec.to_json()) == spec
    True
    """

    layers: tuple[LayerSpec, ...]
    policy: ClipPolicy
    reject_non_finite: bool = False
    privacy: dp.PrivacyPolicy | None = None
    shards: int = 1
    unit: Unit = Unit.EXAMPLE
    client_ids: str = ""
    stream: str = ""  # a buffered stream's buffer: the stream's id ("": not a buffer)
    version: int = 0  # ... and the version it is released as

    def __post_init__(self) -> None:
        object.__setattr__(self, "unit", Unit(self.unit))
        if self.client_ids not in ("", CREDENTIAL, SELF_ASSERTED):
            raise ValueError(f"client_ids: {CREDENTIAL!r}, {SELF_ASSERTED!r} or '', got {self.client_ids!r}")

    @property
    def identity_limits(self) -> list[str]:
        """What a client's identity bounds, in words (empty: nothing): one contribution (unit CLIENT), and a
        correlated stream's participation rules that the server enforces per client."""
        stream = self.privacy.correlated if self.privacy is not None else None
        limited = self.privacy is not None and self.privacy.participation is not None
        return [why for why, given in (
            ("its unit is client: one contribution per client", self.unit is Unit.CLIENT),
            ("its ledger's correlated noise stream limits each client's participation",
             stream is not None and not stream.declared),
            ("its ledger limits each client's participation", limited)) if given]

    @property
    def counts_identities(self) -> bool:
        """Whether a client's identity bounds what it can do (:attr:`identity_limits`)."""
        return bool(self.identity_limits)

    def to_json(self) -> str:
        """The layers, the policy (with the bound in use), the privacy policy and the shard count, as JSON."""
        policy = self.policy
        spec = {
            "shards": self.shards,
            "layers": [[layer.name, list(layer.shape), layer.dtype] for layer in self.layers],
            "policy": {"kind": policy.kind.value, "l2_norm_clip": policy.l2_norm_clip,
                       "layer_clips": list(policy.layer_clips), "rescale_to_unit_norm": policy.rescale_to_unit_norm,
                       "non_finite": policy.non_finite.value},
            "reject_non_finite": self.reject_non_finite,
        }
        if self.privacy is not None:
            spec["privacy"] = dataclasses.asdict(self.privacy)
        if self.unit is not Unit.EXAMPLE:  # (records from before units have neither: examples, no identities)
            spec["unit"] = self.unit.value
        if self.client_ids:
            spec["client_ids"] = self.client_ids
        if self.stream:
            spec["buffer"] = {"stream": self.stream, "version": self.version}
        return json.dumps(spec)

    @classmethod
    def from_json(cls, text: str) -> AggregationSpec:
        """The inverse of :meth:`to_json` (a record from before shards has one)."""
        spec = json.loads(text)
        layers = tuple(LayerSpec(name, tuple(shape), dtype) for name, shape, dtype in spec["layers"])
        privacy = None
        if "privacy" in spec:
            fields = dict(spec["privacy"])
            fields["sampling"] = dp.Sampling(**fields["sampling"])
            if fields["adaptive"] is not None:
                fields["adaptive"] = dp.AdaptiveClipping(**fields["adaptive"])
            if fields.get("correlated") is not None:
                fields["correlated"] = CorrelatedNoise(**fields["correlated"])
            if fields.get("audit") is not None:
                fields["audit"] = CanaryAudit(**fields["audit"])
            if fields.get("participation") is not None:
                fields["participation"] = dp.Participation(**fields["participation"])
            privacy = dp.PrivacyPolicy(**fields)
        buffer = spec.get("buffer", {"stream": "", "version": 0})
        return cls(layers, ClipPolicy(**spec["policy"]), bool(spec["reject_non_finite"]), privacy,
                   int(spec.get("shards", 1)), Unit(spec.get("unit", Unit.EXAMPLE.value)), spec.get("client_ids", ""),
                   buffer["stream"], int(buffer["version"]))

    def release_plan(self) -> dp.ReleasePlan | None:
        """The release's plan under its privacy policy (noise, grid), for the bound in use; None if not private."""
        if self.privacy is None:
            return None
        return self.privacy.plan(self.policy.example_bound(self.layers), self.layers)


class Aggregation:
    """One aggregation: its spec, its state, its clients' sequence numbers, its totals and latest statistics.

    A state machine (:data:`TRANSITIONS`): WARMING_UP -> OPEN -> FINALIZING -> FINALIZED, or FAILED or
    CANCELLED on the way. Its fields are read from outside and written only by its own methods, under
    :attr:`cond` (a shard's totals: by that shard's device worker, through :meth:`add_example` and
    :meth:`absorb`).

    Each client's batch sequence numbers are kept by :class:`ClientSequences`: accepted (taken in: queued or
    summed) >= summed >= durable (in a committed checkpoint). Streams acknowledge ``durable`` only;
    :attr:`pending` counts accepted batches not yet summed. After a restart the marks start at the recovered
    checkpoint's.

    Shards: the aggregation's clients are split over ``shards`` partial states
    (:func:`shard_of`), each summed by one device and checkpointed on its own;
    :attr:`totals` is their merge. A client's marks live in its shard's state.
    """

    def __init__(self, aggregation_id: str, spec: AggregationSpec, max_device_rows: int, staging_bytes: int,
                 recovered: list[PartialState | None] | None = None, created: float | None = None,
                 max_clients: int | None = None, plan=None) -> None:
        """``plan``: the release plan of a private spec (default :meth:`AggregationSpec.release_plan`)."""
        self.id = aggregation_id
        self.spec = spec
        layers, policy, shards = spec.layers, spec.policy, spec.shards
        self.plan = plan if plan is not None else spec.release_plan()  # engine ReleasePlan of the privacy policy
        self.release: dict | None = None  # the committed release's fields
        self._planned_epsilon = 0.0  # the ledger's epsilon once this is released (at creation)
        self.accumulator = make_accumulator(layers, policy, self.plan)
        self.example_bytes = sum(layer.size * np.dtype(layer.dtype).itemsize for layer in layers)
        rows = max(1, min(max_device_rows, staging_bytes // max(1, self.example_bytes)))
        self.device_rows = 1 << (rows.bit_length() - 1)  # a power of two
        self.created = time.time() if created is None else created
        self.cond = threading.Condition()
        # Each open Submit stream's response side waits on its own event, woken only when its client's
        # acknowledgement moves or the aggregation's state changes: waking every stream on every step and
        # checkpoint costs (streams x steps) thread wake-ups, which is what thousands of clients in a round pay.
        self._listeners: dict[str, list[Callable[[int | None], Any]]] = {}
        self._state = State.WARMING_UP
        self._failure_reason = ""
        self._finished: float | None = None  # unix time it was finalized or failed
        self._pending = 0  # batches accepted and not yet summed
        recovered = [None] * shards if recovered is None else recovered  # one checkpoint (or None) per shard
        if len(recovered) != shards:
            raise ValueError(f"aggregation {aggregation_id}: {len(recovered)} recovered shards, not {shards}")
        self._arriving = [0] * shards  # per shard: batches partly received by a stream
        # Each shard's epoch (Store.claim_shard) when the store is shared: checkpoints of an owner that was
        # replaced (another server took over) are refused. None: no claim (one server owns the store).
        self._epochs: list[int | None] = [None] * shards
        # Each shard's totals as of its last flush (a new large model's in the last round's pages, if they fit).
        spare = SPARE_TOTALS.take([layer.shape for layer in layers]) if recovered == [None] else None
        self._shard_totals = [r if r is not None else PartialState.empty(layers, spare) for r in recovered]
        totals = self.totals
        self._sequences = ClientSequences(totals.clients, max_clients)
        self._on_last_stream: list[Callable[[], Any]] = []  # told when its last open stream ends (see detach)
        self._receive_ready = False  # a large model's receive buffers are prepared (it may still be warming up)
        self._progress = Progress(self.created, totals.examples, totals.batches, totals.bytes)
        self._device_stats: list = [None] * shards  # per shard: statistics of its device delta since its flush
        self.result: Result | None = None
        self.released_sums: tuple[np.ndarray, ...] = ()
        self._finalize_lock = threading.Lock()
        # A DP-SGD step's, made and released by one Step call (Lifecycle.create's in_line): its one batch summed
        # on that call's thread, its raw sums never checkpointed (the trainer holds the gradients until the release
        # and resends them after a crash), and until its release its record (``unrecorded``) is not in the store.
        self.in_line = False
        self.unrecorded: AggregationRecord | None = None

    # What it is: its spec's (fixed at creation).
    layers = property(lambda self: self.spec.layers)
    policy = property(lambda self: self.spec.policy)
    reject_non_finite = property(lambda self: self.spec.reject_non_finite)
    privacy = property(lambda self: self.spec.privacy, doc="engine PrivacyPolicy, or None: the sum is released as is")
    weighted = property(lambda self: bool(self.spec.stream),
                        doc="its batches carry weights (a buffered stream's buffer: staleness), its steps take them")

    @property
    def scope(self) -> tuple[float, str | None]:
        """What a credential for it is bound to: its creation time and its ledger (None: not private)."""
        return self.created, self.privacy.ledger_id if self.privacy is not None else None
    shards = property(lambda self: self.spec.shards)
    unit = property(lambda self: self.spec.unit, doc="Unit: an example, or a client identity that contributes once")
    client_ids = property(lambda self: self.spec.client_ids,
                          doc="how its client ids are established where they count: CREDENTIAL, SELF_ASSERTED or ''")
    counts_identities = property(lambda self: self.spec.counts_identities,
                                 doc="whether a client's identity bounds what it can do (AggregationSpec)")

    # Where it is (written by its own methods only).
    state = property(lambda self: self._state, doc="State: where it is in its lifecycle (TRANSITIONS)")
    failure_reason = property(lambda self: self._failure_reason, doc="why it FAILED ('' otherwise)")
    finished = property(lambda self: self._finished, doc="unix time it was finalized or failed, or None")
    pending = property(lambda self: self._pending, doc="batches accepted and not yet summed")
    planned_epsilon = property(lambda self: self._planned_epsilon,
                               doc="its ledger's epsilon once it is released (set at creation: admitted)")
    max_clients = property(lambda self: self._sequences.max_clients)

    def epoch(self, shard: int) -> int | None:
        """The shard's claim epoch on a shared store (its checkpoints carry it), None without a claim."""
        return self._epochs[shard]

    def arriving(self, shard: int) -> int:
        """Batches of the shard that streams are receiving now."""
        return self._arriving[shard]

    def claimed(self, epochs: list[int | None]) -> None:
        """This server claimed the shards (``Store.claim_shard``): their epochs, one per shard (None: not here)."""
        if len(epochs) != self.shards:
            raise ValueError(f"aggregation {self.id}: {len(epochs)} epochs for {self.shards} shards")
        with self.cond:
            self._epochs = list(epochs)

    def admitted(self, planned_epsilon: float) -> None:
        """Its ledger admitted it (at creation): the ledger's epsilon once it is released."""
        with self.cond:
            self._planned_epsilon = planned_epsilon

    def _move_locked(self, to: State) -> None:
        """Moves to ``to`` (:data:`TRANSITIONS`); wakes every stream listening and every waiter."""
        if to is not self._state and to not in TRANSITIONS[self._state]:
            raise InvalidTransition(f"aggregation {self.id}: {self._state.value} -> {to.value}")
        self._state = to
        if to in (State.FINALIZED, State.FAILED) and self._finished is None:
            self._finished = time.time()
        self._wake_locked()
        self.cond.notify_all()

    @classmethod
    def from_record(cls, record, settings, recovered: list[PartialState | None] | None = None) -> Aggregation:
        """The aggregation a store record describes (its spec, id, creation time), with the server's limits
        (``settings``) and each shard's checkpoint (``recovered``): how recovery and shard processes open it."""
        return cls(record.aggregation_id, AggregationSpec.from_json(record.spec), settings.max_device_rows,
                   settings.staging_bytes, recovered=recovered, created=record.created,
                   max_clients=settings.max_clients)

    @property
    def totals(self) -> PartialState:
        """Every shard's totals merged (as of each shard's last flush)."""
        return PartialState.merge_all(self._shard_totals)

    def shard_of(self, client_id: str) -> int:
        return shard_of(client_id, self.shards)

    @functools.cached_property
    def parameters(self) -> int:
        """Elements of all layers together."""
        return sum(layer.size for layer in self.layers)

    def sums_on_host(self, platform: str) -> bool:
        """Whether its steps on a device of ``platform`` measure examples and the worker adds them into the host
        totals itself (one example a step on the CPU: a large model's update is read in place, and no float32
        delta the size of the model is kept), rather than summing them into a device delta (see
        :meth:`ClipAccumulator.measure`)."""
        return self.device_rows == 1 and not self.accumulator.fixed_point_step and platform == "cpu"

    @property
    def state_bytes(self) -> int:
        """What its sums take in memory while open: each shard's float64 totals and, unless a step holds one
        example (a large model: the worker adds it into the totals itself, or the delta is on a GPU), its
        float32 delta."""
        return self.parameters * self.state_bytes_per_parameter * self.shards

    @property
    def state_bytes_per_parameter(self) -> int:
        return TOTALS_BYTES_PER_PARAMETER + (DELTA_BYTES_PER_PARAMETER if self.device_rows > 1 else 0)

    @property
    def memory_bytes(self) -> int:
        """What it holds in memory now: its sums while open, its kept result once finished."""
        if self.state in (*TAKES_BATCHES, State.FINALIZING):
            return self.state_bytes
        result = self.result
        return 0 if result is None else sum(np.asarray(s).nbytes for s in result.sums)

    @property
    def withheld(self) -> bool:
        """Raw statistics are not shown: a privacy policy without debug mode."""
        return self.privacy is not None and not self.privacy.debug_raw_statistics

    @property
    def examples(self) -> int:
        """Examples in the sum so far (durable or about to be); 0 when withheld (a privacy policy)."""
        return 0 if self.withheld else self._progress.examples

    def _check_takes_batches(self) -> None:
        self._check_not_ended()
        if self._state not in TAKES_BATCHES:
            raise FailedPrecondition(f"aggregation {self.id} is {self._state.value}: it takes no more batches")

    # Clients and sequence numbers (ClientSequences) ----------------------------------
    def attach(self, client_id: str, writer: str) -> tuple[int, int, str]:
        """A stream of ``writer`` opens for ``client_id``: ``(durable, accepted, last writer)``
        (:meth:`ClientSequences.attach`)."""
        with self.cond:
            self._check_takes_batches()
            return self._sequences.attach(client_id, writer, f"aggregation {self.id}")

    def batch_arriving(self, client_id: str, change: int) -> None:
        """A stream of ``client_id`` started (+1) or stopped (-1) receiving a batch."""
        with self.cond:
            self._arriving[self.shard_of(client_id)] += change

    def streams_of(self, client_id: str, writer: str) -> int:
        """How many streams of ``writer`` are open for ``client_id``."""
        with self.cond:
            return self._sequences.streams_of(client_id, writer)

    @property
    def receiving(self) -> bool:
        """Whether a Submit stream is open on the aggregation (more batches may come)."""
        return self._sequences.receiving

    def notify_on_last_stream(self, callback: Callable[[], Any]) -> None:
        """``callback()`` runs (outside the lock) each time its last open stream ends: a device worker's step
        waiting for more batches of this aggregation then runs at once."""
        with self.cond:
            self._on_last_stream.append(callback)

    def detach(self, client_id: str, writer: str) -> None:
        """A stream of ``writer`` for ``client_id`` ended (see :meth:`notify_on_last_stream`)."""
        with self.cond:
            last = self._sequences.detach(client_id, writer)
            self.cond.notify_all()
            listeners = list(self._on_last_stream) if last else []
        for notify in listeners:  # (outside the lock: a worker's lock is taken in there)
            notify()

    def listen(self, client_id: str, listener: Callable[[int | None], Any]) -> None:
        """``listener(durable)`` is called (under the lock: it must not block) whenever ``client_id``'s
        durable sequence moves, and ``listener(None)`` whenever the aggregation's state changes (until
        :meth:`unlisten`)."""
        with self.cond:
            self._listeners.setdefault(client_id, []).append(listener)

    def unlisten(self, client_id: str, listener: Callable[[int | None], Any]) -> None:
        with self.cond:
            listeners = self._listeners.get(client_id, [])
            if listener in listeners:
                listeners.remove(listener)
            if not listeners:
                self._listeners.pop(client_id, None)

    def _wake_locked(self, marks: Mapping[str, tuple[int, str]] | None = None) -> None:
        """Tells these clients' listeners their durable sequence; every listener the state when None."""
        if marks is None:
            for listeners in self._listeners.values():
                for listener in listeners:
                    listener(None)
            return
        for client in marks:
            for listener in self._listeners.get(client, ()):
                listener(self._sequences.durable(client))

    def check_contribution(self, client_id: str, sequence: int) -> None:
        """Under unit CLIENT a client contributes one batch, sequence 1 (resent: a duplicate); FAILED_PRECONDITION
        for any later one, before its bytes are read."""
        if self.unit is Unit.CLIENT and sequence > 1:
            raise FailedPrecondition(
                f"aggregation {self.id} counts clients (unit client): client {client_id!r} contributes one batch"
                f" (sequence 1), its whole update, summed and clipped once; batch {sequence} is refused (send every"
                " example in that one batch; the Python client does so under unit client)")

    def accept(self, client_id: str, sequence: int, writer: str = "") -> bool:
        """Reserves a batch: True if new, False if a duplicate of an accepted one (:meth:`ClientSequences.accept`)."""
        self.check_contribution(client_id, sequence)
        with self.cond:
            self._check_takes_batches()
            new = self._sequences.accept(client_id, sequence, writer, f"aggregation {self.id}")
            if new:
                self._pending += 1
            return new

    def summed(self, client_id: str) -> int:
        """The client's highest batch in the sum (durable or not yet)."""
        with self.cond:
            return self._sequences.summed(client_id)

    def durable(self, client_id: str) -> int:
        """The client's highest batch in a committed checkpoint."""
        with self.cond:
            return self._sequences.durable(client_id)

    def accepted_batches(self) -> int:
        """Batches accepted from all clients together."""
        with self.cond:
            return self._sequences.accepted_batches()

    # Called by the worker ---------------------------------------------------------
    def record(self, done: list[tuple[str, str, int, int, int]], device_stats, shard: int = 0) -> None:
        """Marks ``(client, writer, sequence, rows, nbytes)`` batches summed, with the shard's delta statistics."""
        now = time.time()
        with self.cond:
            for client, _, sequence, _, _ in done:
                self._sequences.mark_summed(client, sequence)
                self._pending = max(0, self._pending - 1)  # a failure on another shard already set it to 0
            self._progress.count(sum(d[3] for d in done), len(done), sum(d[4] for d in done), now)
            if device_stats is not None:
                self._device_stats[shard] = device_stats
            self.cond.notify_all()

    # The totals. A shard's are written by the one device worker that sums the shard, through the three methods
    # below, and by no one else: adds of an example or a delta (gigabytes, for a large model) run in place, outside
    # the condition, on that worker's thread alone; the new state is published under the condition. Everyone else
    # reads a shard's state as of its last flush (shard_state), or the merge of every shard (totals).
    def shard_state(self, shard: int) -> PartialState:
        """The shard's totals as of its last flush (read-only: the worker adds into them in place)."""
        return self._shard_totals[shard]

    def add_example(self, shard: int, example, scales) -> None:
        """Adds one measured example into the shard's host sums, in place (``engine.add_example``); the device
        worker of the shard only."""
        sums = self._shard_totals[shard].sums
        assert sums is not None  # (an open shard's totals hold their sums)
        add_example(sums, example, scales)

    def absorb(self, shard: int, delta, marks, batches: int, nbytes: int) -> PartialState:
        """Adds the shard's device delta (and the client marks, batches and bytes it covers) into its totals, in
        place, and publishes them (the delta restarts from zero); the device worker of the shard only."""
        totals = self._shard_totals[shard].absorb(delta, marks, batches, nbytes, in_place=True)
        with self.cond:
            self._shard_totals[shard] = totals
            self._device_stats[shard] = None
        return totals

    def prefault(self, shard: int) -> None:
        """Writes the zeros of the shard's new (lazily mapped) totals, so the first flush does not page-fault them
        in (for a large model, gigabytes of fresh pages); a no-op once it holds anything."""
        totals = self._shard_totals[shard]
        if not (totals.examples or totals.batches or totals.clients):
            for total in totals.sums:
                total.fill(0.0)

    def mark_durable(self, clients: Mapping[str, tuple[int, str]]) -> None:
        """A checkpoint holding these client marks was committed: acknowledge up to them."""
        with self.cond:
            self._sequences.mark_durable(clients)
            self._wake_locked(clients)
            self.cond.notify_all()

    def drop(self, count: int | None = None) -> None:
        """Forgets ``count`` accepted batches that will never be summed (cancelled or failed); all when None
        (a failed aggregation's worker dropped everything it held of it)."""
        with self.cond:
            self._pending = 0 if count is None else max(0, self._pending - count)  # a failure already set 0
            self.cond.notify_all()

    def wait_warmed(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for a large model's receive buffers to be prepared (the first thing
        its warm-up does: an update then streams in while its programs compile and its totals are faulted in,
        and is summed once it opens), or for the warm-up to end; whether one of them came."""
        with self.cond:
            return self.cond.wait_for(lambda: self._receive_ready or self._state is not State.WARMING_UP, timeout)

    def receive_ready(self) -> None:
        """Its receive buffers are prepared (:meth:`wait_warmed`)."""
        with self.cond:
            self._receive_ready = True
            self.cond.notify_all()

    def mark_open(self) -> None:
        """The warm-up is done: OPEN (unless it moved on meanwhile)."""
        with self.cond:
            if self._state is State.WARMING_UP:
                self._move_locked(State.OPEN)

    def fail(self, reason: str, finished: float | None = None) -> bool:
        """Moves to FAILED (True), unless already finished; streams and Finalize then fail with ``reason``.
        ``finished``: when it failed (recovery restores a stored failure's time; default now)."""
        with self.cond:
            if self._state in ENDED:
                return False
            self._failure_reason = reason
            self._finished = finished
            self._move_locked(State.FAILED)
            return True

    # Lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Stops taking batches; FINALIZING until :meth:`wait_drained` sees the last one summed."""
        with self.cond:
            self._check_not_ended()
            if self._state in TAKES_BATCHES:
                self._move_locked(State.FINALIZING)

    def wait_drained(self, timeout: float | None = None) -> bool:
        """Waits until every accepted batch is summed (or the aggregation ended otherwise)."""
        with self.cond:
            return self.cond.wait_for(
                lambda: self._pending == 0 or self._state in (State.CANCELLED, State.FAILED), timeout)

    @property
    def finalize_lock(self) -> threading.Lock:
        """Held by whoever finalizes it (``Lifecycle.finalize``): one finalize at a time, a second waits for the
        first and returns its result."""
        return self._finalize_lock

    def check_not_ended(self) -> None:
        """FAILED_PRECONDITION if it failed or was cancelled (with the reason)."""
        with self.cond:
            self._check_not_ended()

    def finish(self, shard_totals: list[PartialState], released=None, buffers=None) -> Result:
        """The last step of a finalize: every shard's final totals committed (``shard_totals``, merged here: a
        client in two shards is refused, ``OverlapError``), and under a privacy policy the committed release
        (``released``: its ``fields`` and noised ``sums``); FINALIZED, its result kept (its float64 sums dropped).
        ``buffers``: the receive buffers' budget (``ByteBudget``): the sums in their dtypes are written into a set
        of its pooled buffers if it has one of their sizes (a large model's round no longer needs them: its result
        takes no memory beside them), lent until the result is freed."""
        totals = PartialState.merge_all(shard_totals)
        with self.cond:
            self._check_not_ended()
            if released is not None:
                self.release, self.released_sums = released.fields, released.sums
            self._shard_totals = list(shard_totals)
            self._progress.count_to(totals.examples, totals.batches, totals.bytes, time.time())
            self._device_stats = [None] * self.shards
            self.mark_durable(totals.clients)
            self._move_locked(State.FINALIZED)
            self.result = self._result_locked(buffers)
            self._keep_result_only_locked()
            return self.result

    def restore_result(self, finished: float | None, release=None) -> None:
        """Marks a recovered aggregation FINALIZED with its recovered totals (or its release) as the result."""
        with self.cond:
            self._finished = finished
            self._move_locked(State.FINALIZED)
            if release is not None:
                self.release, self.released_sums = release.fields, release.sums
            self.result = self._result_locked()
            self._keep_result_only_locked()

    def _keep_result_only_locked(self) -> None:
        """Drops the float64 sums once the result holds the sums in their dtypes (the store keeps them): a large
        model's one shard's go to ``SPARE_TOTALS``, for the next round."""
        if self.shards == 1:
            SPARE_TOTALS.keep(self._shard_totals[0].sums)
        self._shard_totals = [totals.without_sums() for totals in self._shard_totals]

    def _result_locked(self, buffers=None) -> Result:
        if self.privacy is not None:
            return Result(self._stats_locked(), self.released_sums)
        totals, dtypes = self.totals.sums, [np.dtype(d) for d in self.accumulator.sum_dtypes]
        into = buffers.take_set([s.size * d.itemsize for s, d in zip(totals, dtypes)]) if buffers is not None else None
        if into is None:
            return Result(self._stats_locked(), tuple(s.astype(d) for s, d in zip(totals, dtypes)))
        sums = []
        for total, dtype, buffer in zip(totals, dtypes, into):
            out = buffer.view(dtype).reshape(total.shape)
            np.copyto(out, total, casting="same_kind")  # (rounded as astype rounds)
            buffers.lend_until_freed(out, buffer)
            sums.append(out)
        return Result(self._stats_locked(), tuple(sums))

    def _check_not_ended(self) -> None:
        """FailedPrecondition if it was cancelled or failed."""
        if self._state is State.CANCELLED:
            raise FailedPrecondition(f"aggregation {self.id} was cancelled")
        if self._state is State.FAILED:
            raise FailedPrecondition(f"aggregation {self.id} failed: {self._failure_reason}")

    def cancel(self) -> None:
        """CANCELLED, from any state (its result, if any, is dropped)."""
        with self.cond:
            self._move_locked(State.CANCELLED)
            self.result = None

    # Reading ------------------------------------------------------------------------
    def stats(self) -> Stats:
        """Its statistics, from its own totals and counts (in the process that sums it)."""
        with self.cond:
            return self._stats_locked()

    def stats_over(self, totals: PartialState, counts: Counts, clients: int) -> Stats:
        """Its statistics over numbers kept elsewhere: the control's view of an aggregation that shard hosts sum
        (``shards.hosts.HostedAggregation``) hands in their reported totals (no sums), counts and clients; the
        state, spec, release and what is withheld are the aggregation's own."""
        with self.cond:
            return self._stats_locked(totals, counts, clients)

    def _stats_locked(self, totals: PartialState | None = None, counts: Counts | None = None,
                      clients: int = 0) -> Stats:
        if self.withheld:
            return self._withheld_stats_locked()
        if totals is None or counts is None:
            totals = PartialState.merge_all([self._live_locked(k) for k in range(self.shards)], with_sums=False)
            counts, clients = self._progress.counts(), self._sequences.submitted(totals.clients)
        stats = self._raw_stats_locked(totals, counts, clients)
        if self.privacy is not None:
            return dataclasses.replace(stats, release=self.release, privacy_notice=(
                f"DEBUG: raw statistics of a differentially private aggregation; the epsilon of ledger"
                f" {self.privacy.ledger_id!r} is infinite"))
        return stats

    def _withheld_stats_locked(self) -> Stats:
        """A private aggregation's statistics: its spec and state; numbers only as released (noised)."""
        layers = tuple(LayerStats(spec.name, bound, 0, 0.0, 0.0, ())
                       for spec, bound in zip(self.layers, self._layer_bounds()))
        notice = ("withheld: a differentially private aggregation shows no raw statistic;"
                  + (" see the release for its noised ones" if self.release else
                     " its noised statistics come with the release at finalize"))
        return Stats(self.id, self.state, 0, 0, 0, 0, 0, layers, RATIO_BUCKETS, (),
                     self.policy.example_bound(self.layers), 0.0, 0.0, self.failure_reason,
                     privacy_notice=notice, release=self.release)

    def live_shard_totals(self, shards) -> dict[int, PartialState]:
        """These shards' totals with the statistics of their device deltas since the last flush (no sums of those)."""
        with self.cond:
            return {k: self._live_locked(k) for k in shards}

    def _live_locked(self, shard: int) -> PartialState:
        stats = self._device_stats[shard]
        return self._shard_totals[shard] if stats is None else self._shard_totals[shard].absorb(stats)

    def _raw_stats_locked(self, t: PartialState, counts: Counts, clients: int) -> Stats:
        counted = t.layer_histograms.sum(axis=1)
        bounds = self._layer_bounds()
        layers = tuple(
            LayerStats(
                name=spec.name,
                bound=bounds[i],
                clipped=int(t.clip_counts[i]),
                norm_mean=float(t.norm_sum[i] / counted[i]) if counted[i] else 0.0,
                norm_max=float(t.norm_max[i]),
                norm_histogram=tuple(int(c) for c in t.layer_histograms[i]),
            )
            for i, spec in enumerate(self.layers)
        )
        clipped = int(t.clip_counts[0]) if not self.policy.is_per_layer else int(np.sum(t.clip_counts))
        return Stats(
            aggregation_id=self.id,
            state=self.state,
            examples=counts.examples,
            batches=counts.batches,
            bytes=counts.bytes,
            non_finite=t.non_finite,
            clipped=clipped,
            layers=layers,
            bucket_upper_bounds=RATIO_BUCKETS,
            example_norm_histogram=tuple(int(c) for c in t.example_histogram),
            example_bound=self.policy.example_bound(self.layers),
            updated_unix_seconds=counts.updated_unix_seconds,
            examples_per_second=counts.examples_per_second,
            failure_reason=self.failure_reason,
            clients=clients,
        )

    def submitted_clients(self) -> int:
        """Distinct clients with batches in it: accepted here, or in a shard's totals (spread streams of one client
        count once)."""
        with self.cond:
            return self._sequences.submitted([c for k in range(self.shards) for c in self._live_locked(k).clients])

    def throughput(self) -> tuple[list[tuple[int, int]], bool]:
        """Examples per second, second by second (:meth:`Progress.throughput`), from the series that the
        worker's :meth:`record` keeps; raw data (see :attr:`withheld`)."""
        with self.cond:
            return self._progress.throughput()

    def _layer_bounds(self) -> list[float]:
        """Each layer's bound (the global C for every layer of a GLOBAL policy)."""
        bounds = self.accumulator.bounds
        return [float(bounds[i if self.policy.is_per_layer else 0]) for i in range(len(self.layers))]


HELD_SECONDS = 0.1  # how old Registry.state_bytes' sum may be


class Registry:
    """The aggregations of one server, by id. Only open ones count toward ``max_aggregations``."""

    def __init__(self, max_aggregations: int, max_total_parameters: int | None = None,
                 memory: int | None = None) -> None:
        self.max_aggregations = max_aggregations
        self.max_total_parameters = max_total_parameters
        self.memory = memory  # bytes for what aggregations hold and the updates in flight (None: no check)
        self._lock = threading.Lock()
        self._by_id: dict[str, Aggregation] = {}
        # Ids being published (stored, admitted, warmed up) by a create, outside the lock: they count toward
        # the limits; a second create of the same id waits for the first's outcome.
        self._publishing: dict[str, tuple[Aggregation, threading.Event]] = {}
        self._held: tuple[float, int] | None = None  # (when, state_bytes' sum then): see state_bytes

    def create(self, aggregation_id: str, make, publish) -> tuple[Aggregation, bool]:
        """The aggregation with this id; True if it was created.

        ``make(id)`` builds a new one (under the registry's lock, with the limits checked: it must be cheap)
        and ``publish(aggregation)`` runs before any other request can see it (the server stores it, admits
        it to its ledger and queues its warm-up): outside the lock, so that no ``get``, bind or other create
        waits for a store's fsync or round trip. A create of the same id meanwhile waits, then gets the
        published one (or, if publishing failed, tries again).
        """
        aggregation_id = aggregation_id or uuid.uuid4().hex
        while True:
            with self._lock:
                existing = self._by_id.get(aggregation_id)
                if existing is not None:
                    return existing, False
                underway = self._publishing.get(aggregation_id)
                if underway is None:
                    aggregation = self._admit_locked(aggregation_id, make)
                    published = threading.Event()
                    self._publishing[aggregation_id] = (aggregation, published)
                    self._held = None
                    break
            underway[1].wait()
        try:
            publish(aggregation)
        except BaseException:
            with self._lock:
                del self._publishing[aggregation_id]
            published.set()
            raise
        with self._lock:
            del self._publishing[aggregation_id]
            self._by_id[aggregation_id] = aggregation
            self._held = None
        published.set()
        return aggregation, True

    def _admit_locked(self, aggregation_id: str, make) -> Aggregation:
        """A new aggregation from ``make``, if the open ones and those being published leave room for it."""
        pending = [a for a, _ in self._publishing.values()]
        open_now = [a for a in self._by_id.values() if a.state in (*TAKES_BATCHES, State.FINALIZING)] + pending
        if len(open_now) >= self.max_aggregations:
            raise ResourceExhausted(
                f"{len(open_now)} aggregations are open, the limit is {self.max_aggregations};"
                " finalize or cancel some"
            )
        aggregation = make(aggregation_id)
        held = sum(a.parameters for a in open_now)
        if self.max_total_parameters is not None and held + aggregation.parameters > self.max_total_parameters:
            raise ResourceExhausted(
                f"open aggregations hold {held} parameters; {aggregation.parameters} more would pass the"
                f" limit of {self.max_total_parameters} (max_total_parameters); finalize or cancel some"
            )
        if self.memory is not None:
            self._check_memory(aggregation, sum(a.memory_bytes for a in [*self._by_id.values(), *pending]))
        return aggregation

    def _check_memory(self, aggregation: Aggregation, held: int) -> None:
        """Refuses an aggregation whose sums and one update in flight do not fit the memory budget now."""
        needed = aggregation.state_bytes + aggregation.example_bytes
        if self.memory is not None and held + needed > self.memory:
            raise ResourceExhausted(
                f"aggregation of {aggregation.parameters} parameters: its sums take {aggregation.state_bytes} bytes"
                f" ({aggregation.shards} shard(s) x {aggregation.state_bytes_per_parameter} bytes a parameter) and"
                f" an update"
                f" {aggregation.example_bytes} more; the memory budget is {self.memory} bytes (memory_budget), of"
                f" which aggregations hold {held} (open ones their sums, finished ones their results)"
                + ("; cancel finished aggregations whose results were fetched, or finalize open ones" if held
                   else ""))

    def state_bytes(self) -> int:
        """Bytes the aggregations hold: the open ones' sums (totals and device deltas, every shard), the finished
        ones' kept results, a finished one's sums kept for the next round (``SPARE_TOTALS``); those being created
        count already.

        Asked for each batch received, it is summed over the aggregations at most every ``HELD_SECONDS`` (a
        server keeps hundreds: a stream's kept versions, finished rounds), and again at once after one is
        created, added or removed. In between an aggregation only gives memory back (open sums become a smaller
        result, or nothing), so the figure errs on the safe side."""
        now = time.monotonic()
        with self._lock:
            if self._held is not None and now - self._held[0] < HELD_SECONDS:
                return self._held[1]
            held = sum(a.memory_bytes for a in [*self._by_id.values(), *(a for a, _ in self._publishing.values())])
            self._held = (now, held + SPARE_TOTALS.nbytes)
            return self._held[1]

    def add(self, aggregation: Aggregation) -> None:
        """Adds a recovered aggregation."""
        with self._lock:
            self._by_id[aggregation.id] = aggregation
            self._held = None

    def get(self, aggregation_id: str) -> Aggregation:
        with self._lock:
            aggregation = self._by_id.get(aggregation_id)
        if aggregation is None:
            raise NotFound(f"no aggregation {aggregation_id!r}")
        return aggregation

    def identities(self) -> list[tuple[str, float]]:
        """(id, created) of every aggregation known here: what the submit tokens are bound to."""
        with self._lock:
            return [(a.id, a.created) for a in self._by_id.values()]

    def scope(self, aggregation_id: str) -> tuple[float, str | None] | None:
        """What a credential for the aggregation is bound to: its creation time and its ledger (None: not
        private); None if it is unknown here."""
        with self._lock:
            aggregation = self._by_id.get(aggregation_id)
        return None if aggregation is None else aggregation.scope

    def remove(self, aggregation_id: str) -> Aggregation:
        with self._lock:
            aggregation = self._by_id.pop(aggregation_id, None)
            self._held = None
        if aggregation is None:
            raise NotFound(f"no aggregation {aggregation_id!r}")
        return aggregation

    def all(self) -> list[Aggregation]:
        with self._lock:
            return list(self._by_id.values())

    def expired(self, before: float) -> list[Aggregation]:
        """Finalized or failed aggregations that finished before ``before`` (unix seconds)."""
        with self._lock:
            return [a for a in self._by_id.values()
                    if a.state in (State.FINALIZED, State.FAILED) and a.finished is not None and a.finished < before]
