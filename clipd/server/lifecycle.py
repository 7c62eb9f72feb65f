"""An aggregation's life, top to bottom: create, submit, finalize (with its release), cancel, fail.

The RPC surface (:mod:`clipd.server.rpc`) checks who asks and turns messages into the calls
below; the shards (:class:`Shards`, any kind) clip and sum; the store keeps what must outlive
the process. Every state change of an aggregation is made here or in
:class:`~clipd.server.aggregations.Aggregation` itself, and :func:`fail` is the one way an
aggregation fails, whoever finds the fault (a device worker, a shard process, a Ray actor), but
one: a private release the ledger refuses at finalize is recorded FAILED by ``Ledgers.release``
itself, in the same store transaction as the ledger's entry.

::

    create   spec checked -> (privacy: ledger admits the release) -> store record -> shards warm up
    draw     (sampling drawn by the server) which candidates take part in the release (server.sampling)
    submit   (its client drawn, its participation allowed) -> finite? (policy REJECT) -> Aggregation.accept
             (sequence numbers; unit client: one batch)
             -> (unit client: the batch's rows summed) -> Shards.submit
    finalize close -> drain -> Shards.commit_final (every shard's last checkpoint) -> FINALIZED in the store,
             or the private release (noise, ledger and FINALIZED in one commit) -> Aggregation.finish
    cancel   registry, ledger reservation, store record, shards' state: gone
    fail     FAILED in memory and in the store; streams and Finalize answer with the reason
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Protocol, runtime_checkable

import numpy as np

from clipd.engine import BoundKind, NonFinite, PartialState, Unit, contribution_rows
from clipd.engine import _audit as audit
from clipd.engine import _privacy as dp
from clipd.server.aggregations import (
    CREDENTIAL,
    SELF_ASSERTED,
    Aggregation,
    AggregationSpec,
    Registry,
    Result,
    State,
    Stats,
)
from clipd.server.errors import AlreadyExists, ClipdError, DeadlineExceeded, FailedPrecondition, InvalidArgument
from clipd.server.logs import event
from clipd.server.privacy import Ledgers, prepare_release
from clipd.server.settings import Settings
from clipd.server.stores.base import FAILED, FINALIZED, AggregationRecord, Store

log = logging.getLogger(__name__)


@runtime_checkable
class Shards(Protocol):
    """Where an aggregation's accepted batches are clipped and summed: one seam, three kinds, one summing runtime.

    :class:`~clipd.server.summing.devices.Devices` (this process's JAX devices, a device worker each),
    and :class:`~clipd.server.shards.hosts.ShardHosts` (shard hosts that each run ``Devices``: local
    subprocesses of ``--processes N`` or Ray actors of ``--ray``, started by their launcher).
    tests/shards_contract.py is the contract each of them is run against.
    """

    def __len__(self) -> int:
        """The default number of shards of a new aggregation."""

    def endpoints(self) -> list[str]:
        """Where clients may send each shard's batches directly (``[]``: to this server)."""

    def submit(self, aggregation: Aggregation, client: str, writer: str, batch) -> None:
        """Queues an accepted batch on its client's shard; it becomes durable at a later checkpoint."""

    def sum_in_line(self, aggregation: Aggregation, client: str, writer: str, batch) -> None:
        """Sums an accepted whole batch now, on the caller's thread (a DP-SGD step's); ``Unimplemented`` where
        this process does not sum."""

    def warm_up(self, aggregation: Aggregation) -> None:
        """Opens the aggregation's shards (compiles their programs) before it takes batches."""

    def commit_final(self, aggregation: Aggregation, timeout: float | None = None) -> list[PartialState]:
        """Every shard's final checkpoint, committed; their totals by shard."""

    def forget(self, aggregation: Aggregation) -> None:
        """Drops the aggregation's state on the shards (cancelled)."""

    def finished(self, aggregation: Aggregation) -> None:
        """The aggregation is finalized: the shards may drop their copies."""

    def stats(self, aggregation: Aggregation) -> Stats:
        """Its statistics where its numbers are: its own (summed here), or its shard hosts' reports."""

    def throughput(self, aggregation: Aggregation) -> tuple[list[tuple[int, int]], bool]:
        """Its examples per second, second by second (``Progress.throughput``), counted where it is summed."""

    @property
    def ready(self) -> bool:
        """Every shard host can take batches."""

    @property
    def queued_bytes(self) -> int: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def device_kind(self) -> str: ...

    def describe(self) -> list[dict]:
        """Each device (or actor) at work: ``{"id", "kind", "platform", "steps", ...}``."""

    def stop(self, timeout: float | None = None) -> None: ...


def claims_shards(store: Store, settings: Settings, spec: AggregationSpec) -> bool:
    """Whether this server claims an aggregation's shards itself: a shared store, and no shard processes or Ray
    shard hosts (they claim their own), or a buffered stream's buffer (summed here: ``shards.routed``)."""
    return store.shared and (bool(spec.stream) or not (settings.ray_address or settings.processes))


def fail(aggregation: Aggregation, store: Store | None, reason: str) -> bool:
    """Fails ``aggregation`` (True), unless it had already finished: FAILED in memory, then in ``store``.

    ``store=None``: the store already says so, or another process records it (a shard
    process leaves that to the control process). The store may itself be what failed:
    a write that fails is logged, and the aggregation stays FAILED here.
    """
    if not aggregation.fail(reason):
        return False
    event(log, "aggregation.failed", logging.ERROR, aggregation=aggregation.id, reason=reason)
    if store is not None:
        try:
            store.set_state(aggregation.id, FAILED, reason=reason, finished=time.time())
        except Exception:
            log.exception("could not record the failure of aggregation %s", aggregation.id)
    return True


class Lifecycle:
    """The aggregations of one server and the calls that move them along (see the module's drawing)."""

    def __init__(self, settings: Settings, registry: Registry, shards: Shards, store: Store,
                 ledgers: Ledgers) -> None:
        self.settings = settings
        self.registry = registry
        self.shards = shards
        self.store = store
        self.ledgers = ledgers

    # create -------------------------------------------------------------------------------------
    def create(self, requested_id: str, layers, policy, reject: bool, privacy=None, unit: Unit = Unit.EXAMPLE,
               self_asserted_client_ids: bool = False, stream: str = "", version: int = 0,
               in_line: bool = False) -> Aggregation:
        """The aggregation ``requested_id`` (a new id if empty), created and durable; the same one again
        for a request that repeats it; ``AlreadyExists`` for another spec under that id.

        ``unit``: the privacy unit (an example, or a client that contributes once). Where identities count
        (unit CLIENT, or a correlated stream's enforced participation), its client ids come from credentials,
        unless ``self_asserted_client_ids`` (or the server has no admin token: it authenticates no one).
        ``stream``, ``version``: a buffered stream's buffer, released as that version (``server.streams``).
        ``in_line``: a DP-SGD step's (``rpc.steps``), released by the call that made it: its one batch is summed on
        that call's thread (:meth:`submit`), and its record waits for its release, written in the release's commit
        (unless its ledger's admission writes an entry with it); no warm-up, no shard claims: it is OPEN at once."""
        plan = None
        if privacy is not None:
            privacy = self.ledgers.with_strategy(privacy)  # a correlated stream's, from its ledger (or made)
            policy, plan = self._private_policy(policy, privacy, layers)
        spec = AggregationSpec(layers, policy, reject, privacy, self.settings.shards or len(self.shards), unit,
                               stream=stream, version=version)
        if spec.counts_identities:
            asserted = self_asserted_client_ids or not self.settings.admin_token
            spec = dataclasses.replace(spec, client_ids=SELF_ASSERTED if asserted else CREDENTIAL)
        if privacy is not None and privacy.sampling.drawn_by is dp.DrawnBy.SERVER:
            check_identities(spec, bool(self.settings.admin_token), "privacy.sampling: the server draws clients"
                                                                    " by their ids (drawn_by server)")
        if privacy is not None and privacy.participation is not None:
            check_identities(spec, bool(self.settings.admin_token), "privacy.participation: the server limits each"
                                                                    " client's participation by its id")

        def make(aggregation_id: str) -> Aggregation:
            aggregation = Aggregation(aggregation_id, spec, self.settings.max_device_rows,
                                      self.settings.staging_bytes, max_clients=self.settings.max_clients, plan=plan)
            aggregation.in_line = in_line
            return aggregation

        def publish(aggregation: Aggregation) -> None:  # durable before anyone can see it (a step's: see above)
            record = AggregationRecord(aggregation.id, spec.to_json(), created=aggregation.created)

            def create_record(ledger_entry=None) -> None:
                if in_line and ledger_entry is None:
                    aggregation.unrecorded = record  # written with its release (Ledgers.release)
                elif not self.store.create(record, ledger_entry=ledger_entry):
                    raise AlreadyExists(f"aggregation {aggregation.id!r} exists in the store")

            if privacy is None:
                create_record()
            else:
                assert plan is not None  # (a private spec has its release plan)
                aggregation.admitted(self.ledgers.admit(aggregation, privacy, plan, create_record))
            if in_line:
                aggregation.mark_open()
                return
            self._claim_shards(aggregation)
            self.shards.warm_up(aggregation)

        aggregation, created = self.registry.create(requested_id, make, publish)
        if not created and not _same_request(aggregation, spec):
            raise AlreadyExists(f"aggregation {aggregation.id!r} exists with another spec or policy")
        if created and privacy is not None:
            prepare_release(aggregation)
        if created:
            event(log, "aggregation.created", aggregation=aggregation.id, layers=len(layers),
                  parameters=aggregation.parameters, policy=policy.kind.value,
                  ledger=privacy.ledger_id if privacy else None, unit=unit.value,
                  client_ids=spec.client_ids or None)
        return aggregation

    def _private_policy(self, policy, privacy, layers):
        """The clip policy with the ledger's adaptive bound, and the release plan; ``InvalidArgument`` if unfit."""
        if privacy.adaptive is not None:
            if policy.kind is not BoundKind.GLOBAL or policy.rescale_to_unit_norm:
                raise InvalidArgument("privacy.adaptive: adaptive clipping needs a GLOBAL clip policy without"
                                      " rescale_to_unit_norm")
            policy = dataclasses.replace(policy, l2_norm_clip=self.ledgers.current_bound(privacy))
        if policy.rescale_to_unit_norm:
            raise InvalidArgument("privacy: rescale_to_unit_norm changes the sensitivity; release the plain clipped"
                                  " sum")
        bound = policy.example_bound(layers)
        if not math.isfinite(bound):
            raise InvalidArgument("privacy: an infinite bound (no clipping) has no finite sensitivity")
        if privacy.noise is dp.Noise.SECURE and (policy.kind is not BoundKind.GLOBAL
                                                 or policy.non_finite is not NonFinite.ZERO_EXAMPLE):
            raise InvalidArgument("privacy.noise SECURE sums in fixed point: it needs a GLOBAL clip policy whose"
                                  " non-finite examples are zeroed (ZERO_EXAMPLE) or rejected (REJECT)")
        try:
            plan = privacy.plan(bound, layers)
            if privacy.audit is not None:
                audit.check_canaries(privacy.audit.canaries, sum(layer.size for layer in layers))
        except ValueError as e:
            raise InvalidArgument(f"privacy: {e}") from None
        return policy, plan

    def _claim_shards(self, aggregation: Aggregation) -> None:
        """On a shared store, this server becomes the owner of the aggregation's shards (a new epoch each).

        Another server that later claims them (it took over: a rolling update, a
        failover) fences this one out: its checkpoints are refused from then on,
        so two servers never both acknowledge batches of one shard. Shard
        processes and Ray actors claim for themselves.
        """
        if claims_shards(self.store, self.settings, aggregation.spec):
            aggregation.claimed([self.store.claim_shard(aggregation.id, k) for k in range(aggregation.shards)])

    # submit -------------------------------------------------------------------------------------
    def check_participation(self, aggregation: Aggregation, client: str) -> None:
        """Refuses a client that its ledger's correlated noise stream does not let take part in this release
        (``Ledgers.check_participation``): before any of its bytes are summed."""
        if aggregation.privacy is not None:
            self.ledgers.check_participation(aggregation.privacy, client)

    def draw_clients(self, aggregation_id: str, candidates) -> tuple[Aggregation, int, float, list[str]]:
        """Which ``candidates`` the server draws for the aggregation's release (``Ledgers.draw_clients``)."""
        aggregation = self.registry.get(aggregation_id)
        return (aggregation, *self.ledgers.draw_clients(aggregation, candidates))

    def submit(self, aggregation: Aggregation, client: str, writer: str, batch) -> None:
        """Hands a whole batch to its shard (an in-line aggregation's: sums it now, on this thread), or lets go of it
        (a duplicate, or refused)."""
        try:
            if aggregation.reject_non_finite:
                check_finite(batch, aggregation)
            if not aggregation.accept(client, batch.sequence, writer):
                batch.give_back()  # a duplicate of an accepted batch
                return
            if aggregation.unit is Unit.CLIENT:  # the client's one contribution: its rows summed, clipped once
                layers = contribution_rows(aggregation.unit, batch.layers)
                batch = batch._replace(rows=layers[0].shape[0], layers=layers)
            try:
                (self.shards.sum_in_line if aggregation.in_line else self.shards.submit)(aggregation, client,
                                                                                           writer, batch)
            except ClipdError:
                aggregation.drop(1)
                raise
        except BaseException:
            batch.give_back()
            raise

    # finalize and release --------------------------------------------------------------------------
    def finalize(self, aggregation_id: str, result_buffers=None, drop: Aggregation | None = None) -> Result:
        """Closes the aggregation, waits for its last batch, commits and keeps the result (idempotent): close,
        drain, commit every shard's final checkpoint (an in-line aggregation's totals are final as they are),
        release (under a privacy policy: noise, ledger and FINALIZED in one commit; a release the ledger refuses
        fails the aggregation), finish (FINALIZED, the result kept).
        ``result_buffers``: see :meth:`Aggregation.finish`. ``drop``: a finalized in-line aggregation whose rows
        the release's commit deletes (a trainer's step before: :meth:`forget` then drops it here)."""
        aggregation = self.registry.get(aggregation_id)
        timeout = self.settings.finalize_timeout
        with aggregation.finalize_lock:
            if aggregation.result is not None:  # finalized already (a retry, or a second caller that waited)
                return aggregation.result
            aggregation.close()
            if not aggregation.wait_drained(timeout):
                raise DeadlineExceeded(f"aggregation {aggregation.id}: {aggregation.pending} accepted batches not"
                                       f" summed after {timeout:g} s")
            aggregation.check_not_ended()
            if aggregation.in_line:
                shard_totals = [aggregation.shard_state(k) for k in range(aggregation.shards)]
            else:
                shard_totals = self.shards.commit_final(aggregation, timeout)
            released = None
            if aggregation.privacy is None:
                self.store.set_state(aggregation.id, FINALIZED, finished=time.time())
            else:
                try:
                    released = self.ledgers.release(aggregation, PartialState.merge_all(shard_totals),
                                                    aggregation.accumulator.sum_dtypes, drop=drop)
                except FailedPrecondition as e:
                    aggregation.fail(str(e))
                    raise
            result = aggregation.finish(shard_totals, released, result_buffers)
        event(log, "aggregation.finalized", aggregation=aggregation.id, examples=result.stats.examples)
        if not aggregation.in_line:
            self.shards.finished(aggregation)
        return result

    # cancel -------------------------------------------------------------------------------------
    def cancel(self, aggregation_id: str) -> Aggregation:
        """Drops an aggregation (or a finished one's result): queued batches, device state, store."""
        aggregation = self.registry.remove(aggregation_id)
        was = aggregation.state
        aggregation.cancel()
        self.ledgers.forget(aggregation)
        if aggregation.unrecorded is None:  # (an in-line aggregation not released has no record)
            self.store.delete(aggregation.id)  # first: a shard process can't open it again from the store
        if not aggregation.in_line:
            self.shards.forget(aggregation)
        event(log, "aggregation.deleted", aggregation=aggregation.id, was=was.value)
        return aggregation

    def forget(self, aggregation: Aggregation) -> None:
        """Drops a finalized in-line aggregation whose rows a release's commit deleted (``finalize``'s ``drop``);
        nothing if it went already (a concurrent retry's)."""
        try:
            self.registry.remove(aggregation.id)
        except ClipdError:
            return
        aggregation.cancel()
        event(log, "aggregation.deleted", aggregation=aggregation.id, was=State.FINALIZED.value)


def check_identities(spec: AggregationSpec, authenticates: bool, what: str) -> None:
    """``InvalidArgument`` unless the aggregation counts clients (unit CLIENT) whose ids come from credentials,
    so that a caller can't present a name of its choosing: what the server's draws and participation limits
    rest on (``what``, their words)."""
    if spec.unit is not Unit.CLIENT:
        raise InvalidArgument(f"{what}: the aggregation needs unit client")
    if spec.client_ids != CREDENTIAL:
        why = ("the server has no admin token: it authenticates no one, so every client id is self-asserted"
               if not authenticates else "self_asserted_client_ids makes every client id the submitter's choice")
        raise InvalidArgument(f"{what}, which must come from credentials; {why}")


def _same_request(aggregation: Aggregation, spec: AggregationSpec) -> bool:
    """Whether a create request (its ``spec``) repeats the existing aggregation's: the same but for its shards (a
    server's setting) and, with adaptive clipping, its bound (it may have moved since)."""
    asked = dataclasses.replace(spec, shards=aggregation.shards)
    if spec.privacy is not None and spec.privacy.adaptive is not None:
        asked = dataclasses.replace(asked, policy=dataclasses.replace(spec.policy,
                                                                      l2_norm_clip=aggregation.policy.l2_norm_clip))
    return asked == aggregation.spec


def check_finite(batch, aggregation: Aggregation) -> None:
    """``InvalidArgument`` naming the first example that holds NaN or inf (policy REJECT)."""
    for layer, values in zip(aggregation.layers, batch.layers):
        finite = np.isfinite(values.reshape(batch.rows, -1)).all(axis=1)
        if not finite.all():
            row = int(np.argmin(finite))
            raise InvalidArgument(
                f"batch {batch.sequence}, layer {layer.name!r}: example {row} holds NaN or inf,"
                " and the policy rejects non-finite values"
            )
