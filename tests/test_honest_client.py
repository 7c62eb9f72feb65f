"""The client never loses or double-counts silently (a real server on loopback, a real client).

Each test here failed against the client and server before durable
acknowledgements: bad input returned ``SubmitReport(examples=0)``, a reused
``client_id`` lost its second submission, a retried submission double-counted.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import TEST_SETTINGS
from helpers import wait_until
from service_helpers import LAYERS, assert_result_matches, make_updates

from clipd.client import Client, FailedPreconditionError, InvalidUpdateError, UnavailableError
from clipd.server.app import create_server
from clipd.server.settings import Settings


def _rows(updates, start, stop):
    return {name: values[start:stop] for name, values in updates.items()}


def _assert_nothing_summed(client, agg):
    stats = client.stats(agg)
    assert (stats.examples, stats.batches, stats.bytes) == (0, 0, 0)


@pytest.mark.parametrize("bad, layer, words", [
    ({"w": np.zeros((5, 4, 6)), "b": np.zeros((5, 4)), "v": np.zeros((5, 3, 2, 2))}, "w", ["(4, 6)", "(6, 4)"]),
    ({"w": np.zeros((5, 6, 4)), "v": np.zeros((5, 3, 2, 2))}, "b", ["missing"]),
    ({"W": np.zeros((5, 6, 4)), "b": np.zeros((5, 4)), "v": np.zeros((5, 3, 2, 2))}, "", ["'W'"]),
    ({"w": np.zeros((5, 6, 4)), "b": np.zeros((4, 4)), "v": np.zeros((5, 3, 2, 2))}, "", ["5", "4"]),
])
def test_a_bad_update_raises_a_typed_error_and_sends_nothing(client, bad, layer, words):
    agg = client.create_aggregation(LAYERS)
    with pytest.raises(InvalidUpdateError) as info:
        client.submit(agg, bad, client_id="alice")
    for word in words:
        assert word in str(info.value)
    if layer:
        assert info.value.layer == layer
    assert info.value.acknowledged_examples == 0 and info.value.client_id == "alice"
    _assert_nothing_summed(client, agg)


def test_a_bad_update_in_a_stream_stops_it_after_the_good_ones_are_acknowledged(client):
    agg = client.create_aggregation(LAYERS)
    updates = make_updates(30, seed=1)
    good = [_rows(updates, i, i + 1) for i in range(30)]
    transposed = {"w": np.zeros((4, 6), np.float32), "b": np.zeros(4, np.float32), "v": np.zeros((3, 2, 2))}
    with pytest.raises(InvalidUpdateError) as info:
        client.submit(agg, iter(good[:20] + [transposed] + good[20:]), client_id="bob")
    error = info.value
    assert "#20" in str(error) and error.layer == "w"
    assert error.acknowledged_examples == 20  # the first 20 updates, durably
    assert client.stats(agg).examples == 20
    # The exact way on: submit the rest under the same client id (it appends).
    client.submit(agg, iter(good[20:]), client_id=error.client_id)
    assert_result_matches(client.finalize(agg), updates)


def test_a_reused_client_id_appends(client):
    agg = client.create_aggregation(LAYERS)
    updates = make_updates(200, seed=2)
    first = client.submit(agg, _rows(updates, 0, 100), client_id="alice")
    second = client.submit(agg, _rows(updates, 100, 200), client_id="alice")
    assert (first.examples, second.examples) == (100, 100)
    result = client.finalize(agg)
    assert result.examples == 200
    assert_result_matches(result, updates)


def test_two_submissions_under_one_client_id_at_once_are_refused_not_merged(server, client):
    agg = client.create_aggregation(LAYERS)
    updates = make_updates(40, seed=3)

    def slow():
        for i in range(20):
            time.sleep(0.05)  # the first submission stays open for about a second
            yield _rows(updates, i, i + 1)

    outcome = {}

    def first():
        with Client(f"127.0.0.1:{server.port}", message_bytes=64 << 10) as c:
            outcome["first"] = c.submit(agg, slow(), client_id="carol")

    thread = threading.Thread(target=first)
    thread.start()
    aggregation = server.registry.get(agg)
    wait_until(lambda: aggregation.receiving, 5, "the first submission's stream open on the server")
    with pytest.raises(FailedPreconditionError, match="another submission"):
        client.submit(agg, _rows(updates, 20, 40), client_id="carol")
    thread.join(30)
    assert outcome["first"].examples == 20
    assert client.stats(agg).examples == 20  # nothing of the refused one, nothing lost of the first


def test_an_error_says_what_was_acknowledged_and_resume_sends_exactly_the_rest(tmp_path):
    """The server goes away mid-submission; the error carries the progress; resume completes it."""
    settings = Settings(**{**TEST_SETTINGS, "data_dir": str(tmp_path), "grpc_port": 0})
    server, port = create_server(settings)
    updates = make_updates(400, seed=4)
    gate, stopped = threading.Event(), threading.Event()

    def source():
        for i in range(0, 400, 10):
            if i == 200:
                gate.set()
                stopped.wait(10)  # the server stops here
            yield _rows(updates, i, i + 10)

    with Client(f"127.0.0.1:{port}", message_bytes=8 << 10, retry_timeout=0.5) as c:
        agg = c.create_aggregation(LAYERS, aggregation_id="resume-me")
        stopper = threading.Thread(target=lambda: (gate.wait(10), server.stop(grace=0.5), stopped.set()))
        stopper.start()
        with pytest.raises(UnavailableError) as info:
            c.submit(agg, source(), client_id="dave")
        stopper.join()
        error = info.value
        assert error.client_id == "dave"
        assert 0 < error.acknowledged_examples <= 200
        assert error.progress.acknowledged_examples == error.acknowledged_examples
    server, port2 = create_server(Settings(**{**settings.__dict__, "grpc_port": port}))
    try:
        with Client(f"127.0.0.1:{port}", message_bytes=8 << 10) as c:
            report = c.resume(error)
            assert report.examples == 400  # the whole submission, both calls
            result = c.finalize(agg)
        assert_result_matches(result, updates)  # every example once: none lost, none twice
    finally:
        server.stop(grace=0.5)


def test_a_server_restart_is_ridden_out(tmp_path):
    settings = Settings(**{**TEST_SETTINGS, "data_dir": str(tmp_path)})
    server, port = create_server(settings)
    restarted = {}
    updates = make_updates(300, seed=5)
    gate, stopped = threading.Event(), threading.Event()

    def source():
        for i in range(0, 300, 10):
            if i == 150:
                gate.set()
                stopped.wait(10)  # the server stops here
            yield _rows(updates, i, i + 10)

    def restart():
        gate.wait(10)
        server.stop(grace=0)
        stopped.set()
        time.sleep(0.3)  # clients see UNAVAILABLE meanwhile (``reconnects >= 1`` below: they did)
        restarted["server"], _ = create_server(Settings(**{**settings.__dict__, "grpc_port": port}))

    thread = threading.Thread(target=restart)
    with Client(f"127.0.0.1:{port}", message_bytes=8 << 10) as c:
        agg = c.create_aggregation(LAYERS)
        thread.start()
        report = c.submit(agg, source(), client_id="erin")
        thread.join()
        assert report.examples == 300 and report.reconnects >= 1
        result = c.finalize(agg)
    restarted["server"].stop(grace=0.5)
    assert_result_matches(result, updates)
