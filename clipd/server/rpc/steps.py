"""DP-SGD steps in one call (``Step``): the aggregation's own calls, composed in the server.

A trainer's step through the separate calls is four of them (CreateAggregation, Submit until acknowledged,
Finalize, CancelAggregation): four round trips and, on a durable store, a commit each. ``Step`` does the same work
in one call and one commit, and leaves out what a step does not need:

- the step's aggregation is created as CreateAggregation creates it (its reservation on the ledger), *in line*
  (``Lifecycle.create``): its record is not written now but with its release, and it needs no warm-up;
- the gradients are taken as SubmitOne takes a batch and summed on this call's thread
  (:mod:`clipd.server.summing.inline`: the device worker's own steps, with no thread hop), never checkpointed:
  until the answer the trainer holds them, and a retried step sends them again;
- then Finalize, as ever: the release, with its ledger entry, the aggregation's record and the deletion of the step
  before (``previous_id``, an in-line step's finalized aggregation) in one commit.

A step refused on the way (its gradients, the ledger's budget at the release) leaves nothing: its aggregation is
cancelled, and its reservation with it. What a crash leaves (docs/durability.md): before the release commits,
nothing (the retried step starts again); after, the release, which the retried step gets back as it was recorded.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from clipd import wire
from clipd.server.aggregations import Aggregation, Result, State
from clipd.server.errors import ClipdError, InvalidArgument, ResourceExhausted
from clipd.server.rpc.submit import assembler_for, client_of_call

log = logging.getLogger(__name__)
TRAINER = "trainer"  # the client id of a step's gradients that name none


def step(servicer: Any, message: wire.StepMessage, token: str | None, certified: str | None) -> Result:
    """One DP-SGD step (see the module): its release, as Finalize returns it."""
    spec = message.aggregation
    answer = wire.step_answer_nbytes((layer.shape, wire.DTYPE_NAMES.get(layer.dtype, "float32"))
                                     for layer in spec.layers)
    if answer > servicer.settings.max_message_bytes:
        raise ResourceExhausted(f"Step: the step's answer ({answer} bytes) would pass the server's message limit"
                                f" ({servicer.settings.max_message_bytes}): use CreateAggregation, Submit and Finalize")
    if not spec.aggregation_id:
        raise InvalidArgument("aggregation.aggregation_id: a step names its aggregation (a retry names the same)")
    if not spec.HasField("privacy"):
        raise InvalidArgument("aggregation.privacy: a step is a private release; without one, use CreateAggregation,"
                              " Submit and Finalize")
    aggregation = servicer.create(spec, in_line=True)
    previous = _previous(servicer, message.previous_id, aggregation.id)
    try:
        if aggregation.result is None and message.gradients is not None:
            _take(servicer, aggregation, message.gradients, token, certified)
        result = servicer.lifecycle.finalize(aggregation.id, result_buffers=servicer.budget, drop=previous)
    except ClipdError:
        if aggregation.result is None:  # nothing released: the step leaves no aggregation and no reservation
            _cancel(servicer, aggregation.id)
        raise
    servicer.budget.fit_pool()
    if previous is not None:
        if servicer.lifecycle.store.get(previous.id) is None:  # its rows went with this release
            servicer.lifecycle.forget(previous)
        else:  # (this step was released before: a retry's answer)
            servicer.step_drops.put(previous.id)
    elif message.previous_id and message.previous_id != aggregation.id:
        servicer.step_drops.put(message.previous_id)
    return result


def _previous(servicer: Any, previous_id: str, this_id: str) -> Aggregation | None:
    """The step before, if its rows can go with this step's release: an in-line aggregation, finalized."""
    if not previous_id or previous_id == this_id:
        return None
    try:
        previous = servicer.registry.get(previous_id)
    except ClipdError:
        return None
    if previous.in_line and previous.result is not None and previous.state is State.FINALIZED:
        return previous
    return None


def _take(servicer: Any, aggregation: Aggregation, gradients: wire.SubmitMessage, token: str | None,
          certified: str | None) -> None:
    """The step's gradients into its aggregation, as SubmitOne takes a batch, unacknowledged; nothing if a retried
    step's are in already."""
    if gradients.sequence != 1:
        raise InvalidArgument(f"gradients.sequence: a step's gradients are one batch, sequence 1, got"
                              f" {gradients.sequence}")
    client = client_of_call(servicer, token, certified, aggregation, gradients.client_id or TRAINER)
    writer = gradients.writer_id
    aggregation.check_contribution(client, 1)
    _, accepted, _ = aggregation.attach(client, writer)
    try:
        if accepted >= 1:
            return
        assembler = assembler_for(aggregation, servicer.settings, servicer.budget)
        try:
            batch = assembler.add(1, gradients.chunks)
            if batch is None:
                raise InvalidArgument("gradients: a step's gradients are one whole batch in its one message")
        finally:
            assembler.discard()
        servicer.payload_bytes += batch.nbytes
        servicer.lifecycle.submit(aggregation, client, writer, batch)
    finally:
        aggregation.detach(client, writer)


def _cancel(servicer: Any, aggregation_id: str) -> None:
    try:
        servicer.lifecycle.cancel(aggregation_id)
    except ClipdError:  # gone already (a concurrent retry's cancel)
        pass


class StepDrops:
    """Drops earlier steps' aggregations on a thread of its own (started with the first): a finalized one only (an
    open one is not a step that is over), never a buffered stream's buffer."""

    def __init__(self, lifecycle) -> None:
        self.lifecycle = lifecycle
        self._queue: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, aggregation_id: str) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="clipd-step-drops", daemon=True)
                self._thread.start()
        self._queue.put(aggregation_id)

    def _run(self) -> None:
        while True:
            aggregation_id = self._queue.get()
            try:
                aggregation = self.lifecycle.registry.get(aggregation_id)
                if aggregation.result is not None and not aggregation.spec.stream:
                    self.lifecycle.cancel(aggregation_id)
            except ClipdError:  # not there (dropped by a retried step's call, or never made)
                pass
            except Exception:  # a store error: the aggregation stays until cancelled or its retention ends
                log.exception("dropping step %s", aggregation_id)
