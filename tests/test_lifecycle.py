"""Lifecycle: failures are visible and bounded, finished aggregations leave the open limit and expire."""

from __future__ import annotations

import pathlib
import shutil
import time

import pytest

from clipd import cli
from clipd.client import Client, FailedPreconditionError, InvalidArgumentError, NotFoundError, ResourceExhaustedError
from clipd.server.app import create_server
from clipd.server.settings import Settings
from conftest import TEST_SETTINGS
from service_helpers import LAYERS, assert_result_matches, make_updates

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
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and server.store.get(agg) is not None:
            time.sleep(0.1)
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


def test_a_stream_is_woken_for_its_own_client_and_for_state_changes_only():
    """``Aggregation.listen``: a checkpoint covering alice wakes alice's streams, not bob's; a stream of alice
    ending wakes hers; closing the aggregation wakes everyone; after ``unlisten`` nothing does."""
    import threading

    from clipd.engine import ClipPolicy, LayerSpec
    from clipd.server.aggregations import Aggregation

    aggregation = Aggregation("a", (LayerSpec("w", (3,)),), ClipPolicy(), False, 8, 1 << 20)
    alice, bob = threading.Event(), threading.Event()
    aggregation.listen("alice", alice)
    aggregation.listen("bob", bob)
    aggregation.mark_durable({"alice": (1, "w1")})  # a checkpoint with alice's batch 1
    assert alice.is_set() and not bob.is_set() and aggregation.durable("alice") == 1
    alice.clear()
    aggregation.attach("alice", "w1")
    aggregation.detach("alice", "w1")  # her stream ended
    assert alice.is_set() and not bob.is_set()
    alice.clear()
    aggregation.close()
    assert alice.is_set() and bob.is_set()
    alice.clear()
    aggregation.unlisten("alice", alice)
    aggregation.mark_durable({"alice": (2, "w1")})
    aggregation.fail("a test")
    assert not alice.is_set()
