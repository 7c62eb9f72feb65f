"""Large updates (a whole model per client): streamed into the sum in bounded memory.

Small models with small limits force the paths a billion-parameter update takes: an example
larger than a message and than the staging buffer (received straight into the one buffer the
step reads), admission against a memory budget that waits instead of overrunning it, a
checkpoint slower than the idle timeout, 16-bit values on the wire, per-layer bounds, a private
release, and shard processes killed mid-update. benchmarks/large.py measures the speed and the
memory at 2^28 parameters and more.

The float64 references need no model-sized copies per client: update i is ``c_i * v`` for one
vector ``v``, so the clipped sum is ``(sum_i min(1, C / ||c_i v||) c_i) v``.
"""

from __future__ import annotations

import os
import pathlib
import queue
import signal
import threading
import time

import grpc
import ml_dtypes
import numpy as np
import pytest
from conftest import TEST_SETTINGS
from helpers import wait_until
from service_helpers import FaultyProxy, ServerProcess, free_port, reference

from clipd import wire
from clipd.client import Client, Privacy, ResourceExhaustedError
from clipd.server import aggregations
from clipd.server.app import create_server
from clipd.server.rpc import submit
from clipd.server.settings import Settings
from clipd.v1 import clipd_pb2 as pb
from clipd.v1 import clipd_pb2_grpc as pb_grpc

KiB, MiB = 1 << 10, 1 << 20
LAYERS = {"a": (180_000,), "b": (30, 2_000)}  # 240,000 float32 parameters: 960 KB an update
PARAMETERS = 240_000
UPDATE_BYTES = PARAMETERS * 4
LARGE = dict(max_message_bytes=256 * KiB, staging_bytes=64 * KiB)  # an update spans messages and staging


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (from /proc: each one's parent)."""
    parents = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def direction(seed: int = 0) -> dict[str, np.ndarray]:
    """``v``: one fixed float32 vector, split into the layers; its norm is about 490."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in LAYERS.items()}


def scaled(v: dict[str, np.ndarray], c: float) -> dict[str, np.ndarray]:
    return {name: (np.float32(c) * x)[None] for name, x in v.items()}  # one example: a batch of one


def clipped_sum(v: dict[str, np.ndarray], cs, clip: float) -> dict[str, np.ndarray]:
    """The float64 clipped sum of the updates ``c_i * v`` (the float32 products, as sent)."""
    norm = np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in v.values()))
    out = {name: np.zeros(x.shape) for name, x in v.items()}
    for c in cs:
        sent = {name: (np.float32(c) * x).astype(np.float64) for name, x in v.items()}
        factor = min(1.0, clip / (abs(c) * norm)) if c else 1.0
        for name in out:
            out[name] += factor * sent[name]
    return out


def assert_exact(result, expected: dict[str, np.ndarray]) -> None:
    """Sums within 1e-6 of the largest value (float32 steps, float64 totals)."""
    scale = max(np.abs(x).max() for x in expected.values())
    for name, x in expected.items():
        np.testing.assert_allclose(result.sums[name], x, rtol=0, atol=1e-6 * scale)


def wait_open(server, aggregation_id: str) -> None:
    wait_until(lambda: server.registry.get(aggregation_id).state.value == "open", 30, f"{aggregation_id} open")


@pytest.fixture()
def durable_server(tmp_path):
    servers = []

    def start(**overrides):
        settings = Settings(**{**TEST_SETTINGS, **LARGE, "data_dir": str(tmp_path / f"s{len(servers)}"),
                               **overrides})
        server, port = create_server(settings)
        servers.append(server)
        return server, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(grace=1.0)


def test_updates_larger_than_a_message_and_the_staging_buffer_are_summed_exactly(durable_server):
    server, target = durable_server()
    v, cs = direction(), [0.001, -0.0015, 0.5, 3.0]  # norms 0.49, 0.74, 245, 1470: the last two clipped
    with Client(target, message_bytes=128 * KiB) as client:
        agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0)
        reports = [client.submit(agg, scaled(v, c), client_id=f"silo-{i}") for i, c in enumerate(cs)]
        assert server.registry.get(agg).device_rows == 1  # one example per step: no staging copy either
        result = client.finalize(agg)
    assert [r.reconnects for r in reports] == [0] * 4
    assert result.examples == 4 and result.clip_counts == {"a": 2, "b": 2}
    assert_exact(result, clipped_sum(v, cs, 1.0))
    assert server.servicer.budget.used == 0  # every reservation went back once its step had read the buffer


def test_a_large_models_receive_buffers_are_faulted_in_before_it_opens_and_reused_by_the_next_round(durable_server,
                                                                                                     monkeypatch):
    server, target = durable_server()
    budget = server.servicer.budget
    monkeypatch.setattr(aggregations.SPARE_TOTALS, "min_bytes", 0)  # (this model's sums are 1.9 MB: kept too)
    with Client(target, message_bytes=128 * KiB) as client:
        agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0)
        wait_open(server, agg)
        assert budget.pooled == 2 * UPDATE_BYTES  # two updates' buffers (the servicer's RECEIVE_BUFFERS), before any came
        prepared = {array.ctypes.data for entries in budget._pool.values() for _, array in entries}
        v, cs = direction(3), [0.5, 2.0, -3.0]
        for i, c in enumerate(cs):
            client.submit(agg, scaled(v, c), client_id=f"silo-{i}")
        reused = {array.ctypes.data for entries in budget._pool.values() for _, array in entries}
        assert reused == prepared  # every update was received into a prepared buffer: no new one was made
        result = client.finalize(agg)
        assert_exact(result, clipped_sum(v, cs, 1.0))
        # The result (float32 sums: an update's bytes) was written into one set of them, the round being over:
        # no memory beside them; the other set is kept past Finalize, for the next round of these layers.
        kept = server.registry.get(agg).result
        assert {s.ctypes.data for s in kept.sums} < prepared and len(kept.sums) == len(LAYERS)
        assert budget.pooled == UPDATE_BYTES
        left = {array.ctypes.data for entries in budget._pool.values() for _, array in entries}
        assert left == prepared - {s.ctypes.data for s in kept.sums}
        made = budget.fresh
        sums = {a.ctypes.data for a in aggregations.SPARE_TOTALS._kept[0]}  # its float64 totals, kept
        del kept
        client.cancel(agg)  # its result freed: the set it was written into goes back to the pool
        assert budget.pooled == 2 * UPDATE_BYTES
        # The next round of the same layers opens with both sets, before any update (nothing is faulted in), and
        # its totals in the last round's pages, zeroed.
        again = client.create_aggregation(LAYERS, l2_norm_clip=1.0)
        assert {a.ctypes.data for a in server.registry.get(again).totals.sums} == sums
        wait_open(server, again)
        assert {array.ctypes.data for entries in budget._pool.values() for _, array in entries} == prepared
        for i, c in enumerate(cs):
            client.submit(again, scaled(v, c), client_id=f"silo-{i}")
        assert_exact(client.finalize(again), clipped_sum(v, cs, 1.0))
        assert budget.fresh == made  # every update of both rounds was received into the first round's buffers
    # An aggregation whose updates fit a message prepares nothing.
    pooled = budget.pooled
    with Client(target) as client:
        wait_open(server, client.create_aggregation({"w": (1000,)}, l2_norm_clip=1.0))
    assert budget.pooled == pooled > 0
    budget.pool_idle = 0.0
    budget.drop_idle_buffers()  # unused for pool_idle: freed
    assert budget.pooled == 0


def test_updates_sent_while_the_aggregation_warms_up_take_its_prepared_buffers(durable_server):
    """Clients that send as soon as the aggregation is created (it is still warming up: a layout not compiled
    yet) wait for its prepared receive buffers instead of taking new ones beside them."""
    server, target = durable_server()
    budget = server.servicer.budget
    layers = {"a": (180_001,), "b": (30, 2_000)}  # a layout no other test compiled: its warm-up takes a while
    v = {name: np.random.default_rng(5).standard_normal(shape).astype(np.float32) for name, shape in layers.items()}
    with Client(target, message_bytes=128 * KiB) as client:
        agg = client.create_aggregation(layers, l2_norm_clip=1.0)
        assert client.get_aggregation(agg).state == pb.Aggregation.WARMING_UP
        sent = threading.Thread(target=client.submit, args=(agg, scaled(v, 2.0)), kwargs={"client_id": "early"})
        sent.start()
        client.submit(agg, scaled(v, 0.5), client_id="also-early")
        sent.join()
        result = client.finalize(agg)
    assert budget.fresh == 0  # both were received into the two prepared buffers; none was made beside them
    assert_exact(result, clipped_sum(v, [2.0, 0.5], 1.0))


def test_per_layer_bounds_on_large_updates_match_the_reference_api(durable_server):
    _, target = durable_server()
    v = direction(1)
    updates = {name: np.concatenate([np.float32(c) * x[None] for c in (0.001, 0.2, 4.0)]) for name, x in v.items()}
    with Client(target, message_bytes=128 * KiB) as client:
        agg = client.create_aggregation(LAYERS, policy="per_layer_explicit", layer_clips=[2.0, 30.0])
        for i in range(3):
            client.submit(agg, {name: x[i : i + 1] for name, x in updates.items()}, client_id=f"silo-{i}")
        result = client.finalize(agg)
    sums, counts = reference(updates, "per_layer_explicit", layer_clips=[2.0, 30.0])  # opacus' per-layer clipper
    assert result.clip_counts == counts and 0 < counts["a"] < 3  # some clipped, some not
    for name in LAYERS:
        np.testing.assert_allclose(result.sums[name], sums[name], rtol=1e-5, atol=1e-6 * np.abs(sums[name]).max())


def test_admission_waits_for_memory_and_refuses_what_could_never_fit(durable_server):
    # Room for one update in flight beside the sums, not two: the second waits. The sums of a model with one
    # example a step are its float64 totals (8 bytes a parameter): there is no float32 delta.
    state = PARAMETERS * 8
    # buffer_wait is for batches that fit a message; an update that spans messages waits as long as a stream
    # may be silent (and the stream is not idle meanwhile: the server is the one waiting).
    server, target = durable_server(memory_budget=state + UPDATE_BYTES * 3 // 2, buffer_wait=0.01,
                                    stream_idle_timeout=30.0)
    budget = server.servicer.budget
    v, cs = direction(2), [0.5, -0.25, 2.0, 0.001]
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], budget.used)
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with Client(target, message_bytes=128 * KiB) as client:
        agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0)
        assert budget.limit == UPDATE_BYTES * 3 // 2  # what the budget leaves beside the open sums
        errors: list[Exception] = []

        reports = []

        def send(i: int) -> None:
            try:
                reports.append(client.submit(agg, scaled(v, cs[i]), client_id=f"silo-{i}"))
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        assert errors == [] and [r.reconnects for r in reports] == [0] * 4  # waited, not refused
        # A model whose sums and one update do not fit the budget beside the open aggregation's: refused at
        # creation, with the numbers.
        with pytest.raises(ResourceExhaustedError, match=r"memory budget is \d+ bytes \(memory_budget\), of"
                                                         rf" which aggregations hold {state} "):
            client.create_aggregation({"w": (PARAMETERS,)}, l2_norm_clip=1.0)
        result = client.finalize(agg)
        assert_exact(result, clipped_sum(v, cs, 1.0))
        assert 0 < peak[0] <= UPDATE_BYTES * 3 // 2  # never two updates buffered at once

        # A finished aggregation's kept result counts too (float32 sums: 4 bytes a parameter), until cancelled.
        with pytest.raises(ResourceExhaustedError, match=rf"aggregations hold {UPDATE_BYTES} .* cancel finished"):
            client.create_aggregation({"w": (PARAMETERS,)}, l2_norm_clip=1.0)
        client.cancel(agg)
        client.create_aggregation({"w": (PARAMETERS,)}, l2_norm_clip=1.0)


def test_an_example_larger_than_any_buffer_is_refused_at_once_with_its_size(durable_server):
    _, target = durable_server(max_buffered_bytes=UPDATE_BYTES // 2)
    stub = pb_grpc.ClipdStub(grpc.insecure_channel(target))
    with Client(target) as client:
        agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0)
    messages = wire.submit_batch(agg, "big", 1, [x for x in scaled(direction(), 1.0).values()], 128 * KiB)
    started = time.monotonic()
    call = stub.Submit(iter([pb.SubmitRequest.FromString(m) for m in messages]))
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert time.monotonic() - started < 2.0  # no wait for room that can never come
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"one example of {UPDATE_BYTES} bytes, more than the {UPDATE_BYTES // 2} bytes" in info.value.details()
    assert "smaller batches" not in info.value.details()
    assert wire.RETRY_AFTER_KEY not in dict(info.value.trailing_metadata() or ())  # retrying would not help


def test_a_checkpoint_slower_than_the_idle_timeout_never_closes_the_stream_and_progress_is_reported(durable_server):
    server, target = durable_server(stream_idle_timeout=0.5, buffer_wait=0.25)
    save = server.store.save_checkpoint

    def slow_save(*args, **kwargs):  # a disk much slower than the update is large
        time.sleep(1.2)
        return save(*args, **kwargs)

    v = direction(3)
    with Client(target, message_bytes=128 * KiB) as client:
        agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0)
        server.store.save_checkpoint = slow_save
        report = client.submit(agg, scaled(v, 0.5), client_id="patient")
        assert report.reconnects == 0  # not closed as idle while its checkpoint was being written

        # The same on a raw stream, which stays open after its batch: progress messages come while it waits.
        requests: queue.Queue = queue.Queue()
        for message in [wire.submit_request(agg, "raw", 0, [], "w"),
                        *wire.submit_batch(agg, "raw", 1, list(scaled(v, 0.25).values()), 128 * KiB, "w")]:
            requests.put(pb.SubmitRequest.FromString(message))
        responses = []
        call = pb_grpc.ClipdStub(grpc.insecure_channel(target)).Submit(iter(requests.get, None))
        for response in call:
            responses.append(response)
            if response.acknowledged_sequence == 1:
                break
        requests.put(None)
        call.cancel()
        server.store.save_checkpoint = save
        result = client.finalize(agg)
    progress = [r for r in responses[1:] if r.acknowledged_sequence == 0]
    assert progress and all(r.received_bytes == UPDATE_BYTES for r in progress)
    assert any(r.summed_sequence == 1 for r in progress)  # summed, waiting for its checkpoint
    assert_exact(result, clipped_sum(v, [0.5, 0.25], 1.0))


def test_a_connection_cut_inside_an_update_resumes_from_what_the_server_holds(durable_server, monkeypatch):
    # Whatever part the server had read when the connection broke is kept (the least kept, 256 KiB, is not what
    # this test is about). The server's reader may lag the bytes on the wire by its whole flow-control window, so
    # the cut waits until the reader has begun the update (its memory reserved at the first message).
    monkeypatch.setattr(submit, "RESUME_MIN_BYTES", 1)
    server, target = durable_server()
    port = int(target.rsplit(":", 1)[1])
    v, cs = direction(7), [0.5, 0.002]
    proxy = FaultyProxy(port, faults=1, min_bytes=UPDATE_BYTES // 2, max_bytes=UPDATE_BYTES * 3 // 4, seed=3,
                        cut_when=lambda: server.servicer.budget.used > 0)
    try:
        with Client(f"127.0.0.1:{proxy.port}", message_bytes=64 * KiB) as client:
            agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0)
            report = client.submit(agg, scaled(v, cs[0]), client_id="silo")  # cut after 50-75% of it
            client.submit(agg, scaled(v, cs[1]), client_id="other")
            result = client.finalize(agg)
    finally:
        proxy.close()
    assert proxy.cuts == 1 and report.reconnects == 1
    assert report.resumed_bytes > 0  # the server kept what it had received of the update...
    # ...and that was not sent again: after the cut, the rest of that update and the other one (and headers)
    assert proxy.connection_bytes[1] < 2 * UPDATE_BYTES - report.resumed_bytes + 64 * KiB
    assert_exact(result, clipped_sum(v, cs, 1.0))
    assert server.servicer.budget.used == 0


def test_a_broken_update_not_resumed_holds_its_memory_until_the_idle_timeout(durable_server):
    server, target = durable_server(stream_idle_timeout=1.0, buffer_wait=0.5)
    budget = server.servicer.budget
    with Client(target) as client:
        agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0)
    wait_open(server, agg)
    assert budget.pooled == 2 * UPDATE_BYTES  # two receive buffers prepared as it opened
    messages = wire.submit_batch(agg, "gone", 1, list(scaled(direction(), 1.0).values()), 128 * KiB, "w")
    requests = [pb.SubmitRequest.FromString(m) for m in [wire.submit_request(agg, "gone", 0, [], "w"), *messages[:3]]]
    call = pb_grpc.ClipdStub(grpc.insecure_channel(target)).Submit(iter(requests))
    with pytest.raises(grpc.RpcError):  # the stream ends inside its batch: INVALID_ARGUMENT
        list(call)
    assert budget.used == UPDATE_BYTES  # kept for a resuming stream of the same writer...
    wait_until(lambda: not budget.used, 5, "the broken update's memory released", step=0.05)
    # ...for the idle timeout; then freed, not pooled: the prepared buffers it took (its first layer's: 3
    # messages of 128 KiB) are not back.
    assert budget.used == 0 and budget.pooled == 2 * UPDATE_BYTES - LAYERS["a"][0] * 4


@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float16"])
def test_sixteen_bit_values_on_the_wire_are_clipped_and_summed_in_float32(durable_server, wire_dtype):
    _, target = durable_server()
    v, cs = direction(4), [0.001, 2.0]
    narrow = np.dtype(ml_dtypes.bfloat16) if wire_dtype == "bfloat16" else np.dtype(np.float16)
    with Client(target, message_bytes=128 * KiB, wire_dtype=wire_dtype) as client:
        agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0)
        for i, c in enumerate(cs):
            client.submit(agg, scaled(v, c), client_id=f"silo-{i}")
        result = client.finalize(agg)
    # The oracle: each float32 value rounded to the 16-bit format (ml_dtypes / numpy), widened back, then clipped.
    received = [{name: (np.float32(c) * x).astype(narrow).astype(np.float32) for name, x in v.items()} for c in cs]
    expected = {name: np.zeros(x.shape) for name, x in v.items()}
    for update in received:
        norm = np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in update.values()))
        for name, x in update.items():
            expected[name] += min(1.0, 1.0 / norm) * x.astype(np.float64)
    assert_exact(result, expected)
    sent = clipped_sum(v, cs, 1.0)
    assert not all(np.array_equal(result.sums[n], sent[n]) for n in LAYERS)  # the rounding is really there


def test_a_private_release_of_large_updates_is_noised_with_its_stated_stddev(durable_server):
    _, target = durable_server()
    v, cs, z = direction(5), [0.5, 3.0, -2.0], 2.0
    with Client(target, message_bytes=128 * KiB) as client:
        agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=Privacy(
            ledger_id="silos", delta=1e-6, noise_multiplier=z, sampling="none", seed=7))
        for i, c in enumerate(cs):
            client.submit(agg, scaled(v, c), client_id=f"silo-{i}")
        result = client.finalize(agg)
    assert result.release.noise_stddev == pytest.approx(z * 1.0)
    noise = np.concatenate([(result.sums[n] - s).ravel() for n, s in clipped_sum(v, cs, 1.0).items()])
    assert abs(noise.mean()) < 0.05 and noise.std() == pytest.approx(z, rel=0.02)  # 240,000 draws


def test_a_secure_release_of_large_updates_sums_them_on_its_grid(durable_server):
    _, target = durable_server()
    v, cs, z = direction(8), [0.5, 3.0], 1.0
    with Client(target, message_bytes=128 * KiB) as client:
        agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0, privacy=Privacy(
            "silos-secure", 1e-5, noise="secure", accountant="zcdp", noise_multiplier=z))
        for i, c in enumerate(cs):
            client.submit(agg, scaled(v, c), client_id=f"silo-{i}")
        result = client.finalize(agg)
    step, scale = result.release.grid_step, result.release.grid_noise_scale
    released = np.concatenate([result.sums[n].ravel() for n in LAYERS]).astype(np.float64)
    np.testing.assert_array_equal(released / step, np.rint(released / step))  # whole grid steps, noise included
    exact = np.concatenate([s.ravel() for s in clipped_sum(v, cs, 1.0).values()])
    noise = (released - exact) / step  # in grid steps: the discrete Gaussian, plus each example's rounding
    assert noise.std() == pytest.approx(scale, rel=0.02) and abs(noise.mean()) < 0.05 * scale


def test_sigkill_of_shard_processes_mid_update_loses_nothing_acknowledged(tmp_path):
    port = free_port()
    server = ServerProcess(tmp_path / "data", tmp_path / "cache", port, args=(
        "--admin-port", "-1", "--processes", "2", "--max-message-bytes", str(256 * KiB),
        "--staging-bytes", str(64 * KiB), "--checkpoint-interval", "0.2"))
    server.start()
    v, cs = direction(6), [0.001 * (k + 1) * (-1) ** k for k in range(8)] + [1.0, -2.0]
    pulled, killed = threading.Event(), threading.Event()

    def updates():
        for k, c in enumerate(cs):
            if k == 4:
                pulled.set()  # with two updates in the window, at least two are acknowledged by now...
                killed.wait(60)  # ...and the others wait for the crash
            yield scaled(v, c)

    try:
        with Client(f"127.0.0.1:{port}", message_bytes=128 * KiB, window_bytes=2 * UPDATE_BYTES,
                    retry_timeout=90) as client:
            agg = client.create_aggregation(LAYERS, l2_norm_clip=1.0)
            reports, errors = [], []

            def send() -> None:
                try:  # one client, one example per batch: its stream goes to its shard's process
                    reports.append(client.submit(agg, updates(), client_id="silo", spread=1))
                except Exception as e:  # reported below
                    errors.append(e)

            sender = threading.Thread(target=send)
            sender.start()
            assert pulled.wait(60)
            shard_processes = descendants(server.proc.pid)
            assert len(shard_processes) >= 2
            for pid in shard_processes:  # the machine "crashes": every process of the server at once
                os.kill(pid, signal.SIGKILL)
            server.kill()
            killed.set()
            server.start()
            sender.join(120)
            assert not sender.is_alive() and errors == []
            assert reports[0].reconnects >= 1
            result = client.finalize(agg)
    finally:
        server.stop()
    assert result.examples == len(cs)  # each exactly once
    assert_exact(result, clipped_sum(v, cs, 1.0))
