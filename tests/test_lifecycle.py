"""Lifecycle: failures are visible and bounded, finished aggregations leave the open limit and expire."""

from __future__ import annotations

import pathlib
import shutil
import threading
import time

import pytest
from conftest import TEST_SETTINGS
from helpers import wait_until
from service_helpers import LAYERS, assert_result_matches, make_updates

from clipd import cli
from clipd.client import Client, FailedPreconditionError, InvalidArgumentError, NotFoundError, ResourceExhaustedError
from clipd.server.app import create_server
from clipd.server.settings import Settings

FAILED = 5  # clipd.v1.Aggregation.FAILED


def _server(**overrides):
    server, port = create_server(Settings(**{**TEST_SETTINGS, **overrides}))
    return server, Client(f"127.0.0.1:{port}", message_bytes=64 << 10)


def test_finished_aggregations_do_not_count_toward_the_open_limit():
    server, client = _server(max_aggregations=2)
    try:
        updates = make_updates(10)
        done = client.create_aggregation(LAYERS)
        client.submit(done, updates)
        client.finalize(done)
        cancelled = client.create_aggregation(LAYERS)
        client.cancel(cancelled)
        client.create_aggregation(LAYERS)
        client.create_aggregation(LAYERS)  # two open: the limit
        with pytest.raises(ResourceExhaustedError, match="2 aggregations are open"):
            client.create_aggregation(LAYERS)
        assert client.finalize(done).examples == 10  # the finalized one is still there
    finally:
        client.close()
        server.stop(grace=0.5)


def test_finalized_results_expire_after_the_retention_period_and_leave_the_store(tmp_path):
    server, client = _server(retention_seconds=1.0, data_dir=str(tmp_path))
    try:
        agg = client.create_aggregation(LAYERS)
        client.submit(agg, make_updates(5))
        client.finalize(agg)
        assert server.store.get(agg) is not None
        wait_until(lambda: server.store.get(agg) is None, 10, "the expired result gone from the store", step=0.1)
        with pytest.raises(NotFoundError):
            client.get_aggregation(agg)
        assert server.store.get(agg) is None and server.store.load_checkpoint(agg) is None
    finally:
        client.close()
        server.stop(grace=0.5)


def test_cancel_deletes_a_finalized_result(client):
    agg = client.create_aggregation(LAYERS)
    client.submit(agg, make_updates(5))
    client.finalize(agg)
    client.cancel(agg)
    with pytest.raises(NotFoundError):
        client.finalize(agg)


def test_a_failed_checkpoint_fails_the_aggregation_visibly(tmp_path):
    """A real fault: the store's states directory is replaced by a file, so writes fail."""
    server, client = _server(data_dir=str(tmp_path))
    try:
        agg = client.create_aggregation(LAYERS)
        states = pathlib.Path(tmp_path) / "states"
        shutil.rmtree(states, ignore_errors=True)
        states.write_text("not a directory")
        with pytest.raises(FailedPreconditionError, match="checkpoint failed") as info:
            client.submit(agg, make_updates(20), client_id="frank")
        assert info.value.acknowledged_examples == 0  # nothing was durable, so nothing was acknowledged
        described = client.get_aggregation(agg)
        assert described.state == FAILED and "checkpoint failed" in described.failure_reason
        with pytest.raises(FailedPreconditionError, match="failed: checkpoint failed"):
            client.finalize(agg)
        with pytest.raises(FailedPreconditionError, match="failed"):
            client.submit(agg, make_updates(2), client_id="grace")
        other = client.create_aggregation(LAYERS)  # the server itself keeps serving
        assert other != agg
    finally:
        client.close()
        server.stop(grace=0.5)


def test_cancel_and_recreate_of_one_id_keeps_the_new_aggregation(client):
    updates = make_updates(40, seed=9)
    for round_ in range(5):
        agg = client.create_aggregation(LAYERS, aggregation_id="again")
        client.submit(agg, updates, client_id=f"c{round_}")
        if round_ < 4:
            client.cancel(agg)
    assert_result_matches(client.finalize("again"), updates)


def test_float64_layers_are_refused_not_downcast(client):
    with pytest.raises(InvalidArgumentError, match="FLOAT64"):
        client.create_aggregation({"w": (3,)}, dtype="float64")


def test_the_demo_against_a_server_leaves_nothing_behind(server, capsys):
    before = {a.aggregation_id for a in Client(f"127.0.0.1:{server.port}").list_aggregations()}
    assert cli.main(["demo", "--target", f"127.0.0.1:{server.port}", "--examples", "50"]) == 0
    with Client(f"127.0.0.1:{server.port}") as client:
        after = {a.aggregation_id for a in client.list_aggregations()}
    assert after == before
    assert "result matches" in capsys.readouterr().out


def test_a_stream_to_an_unknown_aggregation_fails_fast(client):
    start = time.monotonic()
    with pytest.raises(NotFoundError):
        client.submit("no-such-aggregation-anywhere", make_updates(2))
    assert time.monotonic() - start < 10


def test_a_stream_is_told_of_its_own_client_and_of_state_changes_only():
    """``Aggregation.listen``: a checkpoint covering alice tells alice's listeners her durable sequence, not
    bob's; closing the aggregation tells everyone (None); after ``unlisten`` nothing does."""

    from clipd.engine import ClipPolicy, LayerSpec
    from clipd.server.aggregations import Aggregation, AggregationSpec

    aggregation = Aggregation("a", AggregationSpec((LayerSpec("w", (3,)),), ClipPolicy()), 8, 1 << 20)
    alice, bob = [], []
    aggregation.listen("alice", alice.append)
    aggregation.listen("bob", bob.append)
    aggregation.mark_durable({"alice": (1, "w1")})  # a checkpoint with alice's batch 1
    assert alice == [1] and bob == [] and aggregation.durable("alice") == 1
    aggregation.mark_durable({"alice": (3, "w1"), "carol": (1, "w2")})
    assert alice == [1, 3] and bob == []
    aggregation.close()
    assert alice == [1, 3, None] and bob == [None]
    aggregation.unlisten("alice", alice.append)
    aggregation.mark_durable({"alice": (4, "w1")})
    aggregation.fail("a test")
    assert alice == [1, 3, None] and bob == [None, None]


def test_a_finalize_after_an_acknowledged_checkpoint_writes_it_once(tmp_path):
    """An acknowledgement means a checkpoint holds every batch: the final commit of the same totals
    writes nothing more, and the finalized result survives a restart from that checkpoint. An empty
    aggregation has no checkpoint yet: its final commit writes one."""
    server, client = _server(data_dir=str(tmp_path))
    writes = []
    save = server.store.save_checkpoint
    server.store.save_checkpoint = lambda *a, **k: (writes.append(a[0]), save(*a, **k))[1]
    updates = make_updates(40)
    try:
        agg = client.create_aggregation(LAYERS)
        client.submit(agg, updates, client_id="ada")
        during = len(writes)
        assert during >= 1
        result = client.finalize(agg)
        assert len(writes) == during  # no second copy of the acknowledged totals
        assert_result_matches(result, updates)
        empty = client.create_aggregation(LAYERS)
        assert client.finalize(empty).examples == 0
        assert writes.count(empty) == 1
    finally:
        client.close()
        server.stop(grace=0.5)
    server, client = _server(data_dir=str(tmp_path))
    try:
        assert_result_matches(client.finalize(agg), updates)
    finally:
        client.close()
        server.stop(grace=0.5)


def test_an_aggregation_like_a_compiled_one_opens_without_compiling_its_steps_again(client, monkeypatch):
    """A trainer makes one aggregation per step, all alike: only the first compiles the steps at its warm-up."""
    from clipd.engine import ClipAccumulator

    warm_compiles = []
    compile_step = ClipAccumulator.compile

    def counted(self, *args):
        if threading.current_thread().name.startswith("clipd-warmup"):
            warm_compiles.append(self)
        return compile_step(self, *args)

    monkeypatch.setattr(ClipAccumulator, "compile", counted)

    def open_one(shape) -> None:
        agg = client.create_aggregation({"w": shape, "b": (3,)})
        wait_until(lambda: client.get_aggregation(agg).state == 2, 60, f"{agg} OPEN")  # 2: OPEN

    open_one((7, 13))  # a shape no other test uses: compiled here
    first = len(warm_compiles)
    assert first >= 2  # one program per bucket size
    open_one((7, 13))
    assert len(warm_compiles) == first
    open_one((7, 14))  # another shape: compiled
    assert len(warm_compiles) == 2 * first


def test_a_step_waits_for_more_batches_only_while_a_stream_of_its_aggregation_is_open():
    """FILL_WAIT gathers small batches into one step; once every stream has ended nothing more can come (a
    trainer's one batch per step), and the step must not wait: the last stream's end wakes the worker."""
    from clipd.engine import ClipPolicy, LayerSpec
    from clipd.server.aggregations import Aggregation, AggregationSpec
    from clipd.server.stores.base import MemoryStore
    from clipd.server.summing.worker import DeviceWorker

    worker = DeviceWorker(MemoryStore())
    aggregation = Aggregation("a", AggregationSpec((LayerSpec("w", (3,)),), ClipPolicy()), 8, 1 << 20)
    aggregation.notify_on_last_stream(worker._streams_ended)  # as the worker does when it opens an aggregation
    try:
        started = time.monotonic()
        assert worker._more_for(aggregation, 0, 8, deadline=started + 0.5) is None
        assert time.monotonic() - started < 0.25  # no stream open: no wait
        aggregation.attach("alice", "w1")
        started = time.monotonic()
        assert worker._more_for(aggregation, 0, 8, deadline=started + 0.3) is None
        assert time.monotonic() - started >= 0.29  # alice may still send: it waited to the deadline
        threading.Timer(0.05, aggregation.detach, args=("alice", "w1")).start()
        started = time.monotonic()
        assert worker._more_for(aggregation, 0, 8, deadline=started + 0.5) is None
        assert time.monotonic() - started < 0.2  # alice's stream ended during the wait: it stopped waiting
    finally:
        worker.stop(timeout=5)


def test_fail_is_recorded_in_the_store_once_and_only_where_asked():
    """``lifecycle.fail``: FAILED with the reason in memory and in the store; ``store=None`` leaves the store
    as it is (another process records it); a finished aggregation does not fail again."""
    from clipd.engine import ClipPolicy, LayerSpec
    from clipd.server.aggregations import Aggregation, AggregationSpec, State
    from clipd.server.lifecycle import fail
    from clipd.server.stores.base import AggregationRecord, MemoryStore

    store = MemoryStore()
    for name in ("a", "b"):
        store.create(AggregationRecord(name, "{}", created=1.0))
    a, b = (Aggregation(n, AggregationSpec((LayerSpec("w", (3,)),), ClipPolicy()), 8, 1 << 20) for n in ("a", "b"))
    assert fail(a, store, "disk full")
    assert a.state is State.FAILED and a.failure_reason == "disk full"
    assert (store.get("a").state, store.get("a").reason) == ("failed", "disk full")
    assert not fail(a, store, "again") and store.get("a").reason == "disk full"
    assert fail(b, None, "elsewhere") and b.state is State.FAILED
    assert store.get("b").state == "open"


def test_a_create_waiting_on_its_store_write_holds_up_no_other_call(tmp_path):
    """The registry publishes (stores, admits, warms up) a new aggregation outside its lock: while one create
    waits on a slow store write, reads and other creates go on; a create of the same id waits and gets it."""
    server, client = _server(data_dir=str(tmp_path / "data"), max_aggregations=3)
    store_create, entered, go_on = server.store.create, threading.Event(), threading.Event()

    def slow_create(record, **kwargs):  # the real store write, after a wait the test controls
        if record.aggregation_id == "slow":
            entered.set()
            assert go_on.wait(30)
        return store_create(record, **kwargs)

    server.store.create = slow_create
    results: dict[str, object] = {}
    try:
        existing = client.create_aggregation(LAYERS, aggregation_id="existing")
        threads = [threading.Thread(target=lambda key=key: results.__setitem__(
            key, client.create_aggregation(LAYERS, aggregation_id="slow"))) for key in ("first", "same id")]
        threads[0].start()
        assert entered.wait(10)
        threads[1].start()
        started = time.monotonic()
        assert client.get_aggregation(existing).aggregation_id == existing  # not held up by the store write
        other = client.create_aggregation(LAYERS, aggregation_id="other")
        assert time.monotonic() - started < 5 and other == "other"
        with pytest.raises(ResourceExhaustedError, match="3 aggregations are open"):  # "slow" counts already
            client.create_aggregation(LAYERS, aggregation_id="fourth")
        assert "first" not in results and "same id" not in results  # both wait for the store write
        go_on.set()
        for thread in threads:
            thread.join(30)
        assert results == {"first": "slow", "same id": "slow"}
        assert server.store.get("slow") is not None and server.store.get("fourth") is None
    finally:
        go_on.set()
        client.close()
        server.stop(grace=0.5)
