"""The exactly-once bookkeeping on its own (ClientSequences) and the aggregation's state machine (TRANSITIONS)."""

from __future__ import annotations

import doctest
import itertools

import pytest

from clipd.engine import ClipPolicy, LayerSpec
from clipd.server import sequences
from clipd.server.aggregations import TRANSITIONS, Aggregation, AggregationSpec, InvalidTransition, State
from clipd.server.errors import FailedPrecondition, ResourceExhausted
from clipd.server.sequences import ClientSequences


def test_the_module_doctest():
    assert doctest.testmod(sequences).failed == 0


def test_batches_are_taken_once_in_order():
    seq = ClientSequences()
    assert [seq.accept("alice", n, "w") for n in (1, 2, 2, 1, 3)] == [True, True, False, False, True]
    assert seq.accepted("alice") == 3 and seq.accepted_batches() == 3
    with pytest.raises(FailedPrecondition, match=r"batch 5 after 3; sequence numbers go up by one from 1"):
        seq.accept("alice", 5, "w")
    with pytest.raises(FailedPrecondition, match="batch 2 after 0"):
        seq.accept("bob", 2, "w")
    assert seq.accepted("alice") == 3 and seq.accepted("bob") == 0  # a refusal changes nothing


def test_the_three_marks_move_on_their_own_and_only_up():
    seq = ClientSequences()
    for n in (1, 2, 3):
        seq.accept("alice", n, "w")
    assert (seq.summed("alice"), seq.durable("alice")) == (0, 0)
    seq.mark_summed("alice", 2)
    assert (seq.summed("alice"), seq.durable("alice")) == (2, 0)
    seq.mark_durable({"alice": (2, "w")})
    seq.mark_summed("alice", 1)  # a late, older mark moves nothing back
    seq.mark_durable({"alice": (1, "w")})
    assert (seq.accepted("alice"), seq.summed("alice"), seq.durable("alice")) == (3, 2, 2)
    seq.mark_durable({"alice": (3, "w")})  # (a final commit may report durable before summed)
    assert seq.summed("alice") == 3


def test_a_recovered_checkpoint_sets_every_mark_and_the_last_writer():
    seq = ClientSequences({"alice": (7, "w1"), "bob": (2, "w2")})
    assert seq.attach("alice", "w3") == (7, 7, "w1")
    assert not seq.accept("alice", 7, "w3") and seq.accept("alice", 8, "w3")
    assert (seq.summed("bob"), seq.durable("bob"), seq.accepted_batches()) == (2, 2, 10)


def test_a_second_writer_is_refused_while_the_first_has_a_stream_open():
    seq = ClientSequences()
    assert seq.attach("alice", "w1") == (0, 0, "")
    assert seq.attach("alice", "w1") == (0, 0, "")  # the same submission's second stream (a resume)
    with pytest.raises(FailedPrecondition, match="being written by another submission"):
        seq.attach("alice", "w2")
    assert seq.attach("alice", "") == (0, 0, "")  # a stream without a hello is never refused
    assert seq.streams_of("alice", "w1") == 2
    assert not seq.detach("alice", "w1") and not seq.detach("alice", "")
    assert seq.detach("alice", "w1")  # the last stream open at all
    assert not seq.receiving and seq.streams_of("alice", "w1") == 0
    assert seq.attach("alice", "w2") == (0, 0, "")  # free again


def test_max_clients_counts_a_spread_submission_once_and_frees_a_client_that_sent_nothing():
    seq = ClientSequences(max_clients=2)
    seq.attach("alice~1", "w")
    seq.attach("alice~2", "w")  # the same client (SPREAD_MARK)
    seq.attach("bob", "w")
    assert seq.clients() == 2
    with pytest.raises(ResourceExhausted, match=r"aggregation x has 2 clients, the limit is 2 \(max_clients\)"):
        seq.attach("carol", "w", "aggregation x")
    with pytest.raises(ResourceExhausted):
        seq.accept("carol", 1, "w")
    seq.detach("bob", "w")  # bob never sent a batch: his place is free
    assert seq.clients() == 1
    assert seq.accept("carol", 1, "w")
    seq.detach("alice~1", "w")
    seq.detach("alice~2", "w")
    assert seq.clients() == 1  # alice's streams sent nothing; carol's batch keeps her
    assert seq.accept("dave", 1, "w") and seq.clients() == 2


def _aggregation() -> Aggregation:
    return Aggregation("a", AggregationSpec((LayerSpec("w", (3,)),), ClipPolicy()), 8, 1 << 20)


def test_every_state_pair_outside_the_table_is_refused():
    """Drives an aggregation into each state through its public methods, then tries every move there is."""

    def reach(state: State) -> Aggregation:
        aggregation = _aggregation()
        steps = {
            State.WARMING_UP: [],
            State.OPEN: [aggregation.mark_open],
            State.FINALIZING: [aggregation.mark_open, aggregation.close],
            State.FINALIZED: [lambda: aggregation.restore_result(1.0)],
            State.FAILED: [lambda: aggregation.fail("x")],
            State.CANCELLED: [aggregation.cancel],
        }[state]
        for step in steps:
            step()
        assert aggregation.state is state
        return aggregation

    for start, to in itertools.product(State, State):
        aggregation = reach(start)
        if to is start or to in TRANSITIONS[start]:
            with aggregation.cond:
                aggregation._move_locked(to)
            assert aggregation.state is to
        else:
            with pytest.raises(InvalidTransition, match=f"{start.value} -> {to.value}"), aggregation.cond:
                aggregation._move_locked(to)
            assert aggregation.state is start


def test_the_lifecycle_methods_keep_to_the_table():
    aggregation = _aggregation()
    aggregation.close()
    assert aggregation.state is State.FINALIZING
    aggregation.mark_open()  # a warm-up that ends after a close does not reopen it
    assert aggregation.state is State.FINALIZING
    with pytest.raises(FailedPrecondition, match="it takes no more batches"):
        aggregation.accept("alice", 1)
    assert aggregation.fail("disk full") and aggregation.finished is not None
    assert not aggregation.fail("again") and aggregation.failure_reason == "disk full"
    with pytest.raises(FailedPrecondition, match="failed: disk full"):
        aggregation.close()
    aggregation.cancel()
    assert aggregation.state is State.CANCELLED
    with pytest.raises(AttributeError):
        aggregation.state = State.OPEN  # read-only from outside


def test_pending_counts_accepted_batches_until_summed_or_dropped():
    aggregation = _aggregation()
    aggregation.accept("alice", 1)
    aggregation.accept("alice", 2)
    aggregation.accept("alice", 2)  # a duplicate
    assert aggregation.pending == 2
    aggregation.record([("alice", "", 1, 4, 48)], None)
    assert aggregation.pending == 1 and aggregation.summed("alice") == 1
    aggregation.drop()
    assert aggregation.pending == 0 and aggregation.wait_drained(0)
