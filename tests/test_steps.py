"""A DP-SGD step in one call (``Step``, ``Client.step``, ``DpSgd``'s default): the release the separate calls give,
recorded once whatever is retried (a lost answer, SIGKILL of a real ``clipd serve`` at random points), refused by
the budget and by bad input before anything of it is summed, leaving nothing behind."""

from __future__ import annotations

import random
import threading
import time
import uuid

import grpc
import numpy as np
import pytest
from conftest import TEST_SETTINGS
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant
from helpers import wait_until
from service_helpers import FaultyProxy, ServerProcess, free_port

from clipd import wire
from clipd.client import Client, ClipdError, FailedPreconditionError, Privacy
from clipd.client.dpsgd import DpSgd
from clipd.server.app import create_server
from clipd.server.settings import Settings
from clipd.v1 import clipd_pb2 as pb

LAYERS = {"w": (6, 4), "b": (4,)}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server with the durable (SQLite) store, as a trainer would use it."""
    server, port = create_server(Settings(**{**TEST_SETTINGS, "data_dir": str(tmp_path_factory.mktemp("steps"))}))
    yield server, f"127.0.0.1:{port}"
    server.stop(grace=1.0)


def gradients(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    return {"w": rng.standard_normal((rows, 6, 4)).astype(np.float32),
            "b": rng.standard_normal((rows, 4)).astype(np.float32)}


def rdp_epsilon(sampling_rate: float, noise_multiplier: float, steps: int, delta: float) -> float:
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dpe.PoissonSampledDpEvent(sampling_rate, dpe.GaussianDpEvent(noise_multiplier)), steps)
    return accountant.get_epsilon(delta)


def test_a_step_in_one_call_releases_what_the_separate_calls_release(served):
    """Seeded twins (the same seed on two ledgers): each step's release is the same, bit for bit, with the same
    DpEvent and epsilon; and noiseless, it is the flat-clipped mean over q * n (numpy, Opacus' formula)."""
    _, target = served
    rng = np.random.default_rng(3)
    batches = [gradients(rng, rows) for rows in (5, 0, 9)]
    runs: dict[bool, list] = {}
    with Client(target) as client:
        for one_call in (True, False):
            with DpSgd(client, LAYERS, l2_norm_clip=1.0, noise_multiplier=1.1, sampling_rate=0.05, dataset_size=160,
                       delta=1e-5, seed=11, one_call=one_call) as dp:
                runs[one_call] = [dp.step(batch) for batch in batches]
            assert len(client.ledger(dp.ledger_id).entries) == 3
        with DpSgd(client, LAYERS, l2_norm_clip=1.0, noise_multiplier=0.0, sampling_rate=0.05, dataset_size=160,
                   delta=1e-5) as dp:
            noiseless = dp.step(batches[2])
    for k, (one, separate) in enumerate(zip(runs[True], runs[False])):
        assert one.seconds["step"] > 0 and one.seconds["submit"] == one.seconds["finalize"] == 0  # one call...
        assert separate.seconds["step"] == 0 and separate.seconds["finalize"] > 0  # ...against four
        for name in LAYERS:
            np.testing.assert_array_equal(one.gradient[name], separate.gradient[name])
        assert one.release.dp_event_json == separate.release.dp_event_json
        assert one.epsilon == separate.epsilon == pytest.approx(
            rdp_epsilon(0.05, 1.1, k + 1, 1e-5), rel=1e-9)
    batch = batches[2]
    flat = np.concatenate([batch["w"].reshape(9, -1), batch["b"]], axis=1).astype(np.float64)
    clipped = flat * np.minimum(1.0, 1.0 / np.linalg.norm(flat, axis=1))[:, None]
    mean = clipped.sum(0) / (0.05 * 160)
    np.testing.assert_allclose(noiseless.gradient["w"].reshape(-1), mean[:24], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(noiseless.gradient["b"], mean[24:], rtol=1e-5, atol=1e-6)


def test_a_step_whose_answer_is_lost_is_retried_and_returns_the_release_recorded_once(served):
    """The connection is cut as the answer comes back (the server released the step); the client's retry gets the
    release as it was recorded: one ledger entry, the same noised sums (noise is fresh per release: a second
    release would differ)."""
    _, target = served
    port = int(target.rsplit(":", 1)[1])
    ledger = f"lost-{uuid.uuid4().hex[:8]}"
    with Client(target) as admin:
        def released() -> bool:
            try:
                return len(admin.ledger(ledger).entries) >= 1
            except ClipdError:  # (no ledger before the first release)
                return False

        proxy = FaultyProxy(port, faults=1, min_bytes=1 << 40, max_bytes=1 << 40, cut_answer_when=released)
        try:
            with Client(f"127.0.0.1:{proxy.port}", retry_timeout=30.0) as client, \
                    DpSgd(client, LAYERS, l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=0.1, dataset_size=50,
                          delta=1e-5, ledger_id=ledger) as dp:
                step = dp.step(gradients(np.random.default_rng(5), 4))
                kept = client.finalize(step.aggregation_id)  # the release as the server keeps it
        finally:
            proxy.close()
        assert proxy.cuts == 1 and len(proxy.connection_bytes) == 2  # cut once, answered on a second connection
        entries = admin.ledger(ledger).entries
    assert [e.aggregation_id for e in entries] == [step.aggregation_id]
    assert step.epsilon == entries[0].epsilon_after
    for name in LAYERS:
        np.testing.assert_array_equal(step.gradient[name], kept.sums[name])


def test_the_budget_refuses_the_step_that_would_pass_it_and_nothing_of_it_stays(served):
    _, target = served
    rng = np.random.default_rng(0)
    with Client(target) as client:
        with DpSgd(client, LAYERS, l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=0.5, dataset_size=8,
                   delta=1e-5, max_epsilon=rdp_epsilon(0.5, 1.0, 3, 1e-5) * 1.0001) as dp:
            steps = [dp.step(gradients(rng, 4)).aggregation_id for _ in range(3)]
            # Each step is dropped by the server after the next one's call (in the background).
            wait_until(lambda: not set(steps[:2]) & {a.aggregation_id for a in client.list_aggregations()}, 10,
                       "the first two steps dropped", step=0.05)
            held = {a.aggregation_id for a in client.list_aggregations()}
            assert steps[-1] in held
            with pytest.raises(FailedPreconditionError, match="budget"):
                dp.step(gradients(rng, 4))
            assert {a.aggregation_id for a in client.list_aggregations()} == held  # no aggregation of it
            assert dp.steps == 3
        ledger = client.ledger(dp.ledger_id)
        assert len(ledger.entries) == 3
        assert ledger.epsilon == pytest.approx(rdp_epsilon(0.5, 1.0, 3, 1e-5), rel=1e-9)
        assert steps[-1] not in {a.aggregation_id for a in client.list_aggregations()}  # closing dropped the last


def test_bad_steps_are_invalid_argument_and_leave_no_aggregation_and_no_reservation(served):
    _, target = served
    privacy = Privacy(f"bad-{uuid.uuid4().hex[:8]}", 1e-5, noise_multiplier=1.0, sampling="poisson",
                      sampling_rate=0.1).to_proto()

    def spec(aggregation_id: str, with_privacy: bool = True) -> pb.CreateAggregationRequest:
        request = pb.CreateAggregationRequest(layers=[pb.LayerSpec(name="w", shape=[3], dtype=pb.FLOAT32)],
                                              policy=wire.clip_policy("global", "zero_example", l2_norm_clip=1.0),
                                              aggregation_id=aggregation_id)
        if with_privacy:
            request.privacy.CopyFrom(privacy)
        return request

    good = [np.ones((2, 3), np.float32)]
    cases = {
        "aggregation_id": wire.step_request(spec(""), "t", good),
        "privacy": wire.step_request(spec("bad-1", with_privacy=False), "t", good),
        "shape [2, 4], expected [batch, 3]": wire.step_request(spec("bad-2"), "t", [np.ones((2, 4), np.float32)]),
        "sequence 1, got 2": wire.step_request(spec("bad-3"), "t", good).replace(
            wire.varint(pb.SubmitRequest.SEQUENCE_FIELD_NUMBER << 3) + wire.varint(1),
            wire.varint(pb.SubmitRequest.SEQUENCE_FIELD_NUMBER << 3) + wire.varint(2)),
        "malformed Step request": b"\x0a\xff\xff",
    }
    with grpc.insecure_channel(target) as channel, Client(target) as client:
        step = channel.unary_unary(wire.STEP_METHOD, request_serializer=None,
                                   response_deserializer=pb.StepResponse.FromString)
        for words, request in cases.items():
            with pytest.raises(grpc.RpcError) as refused:
                step(request, timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.details(), \
                (words, refused.value.details())
        assert not {"bad-1", "bad-2", "bad-3"} & {a.aggregation_id for a in client.list_aggregations()}
        # The ledger plans the next release as its first: no refused step's reservation is on it.
        again = client.create_aggregation({"w": (3,)}, l2_norm_clip=1.0, privacy=privacy)
        assert client.get_aggregation(again).planned_ledger_epsilon == pytest.approx(
            rdp_epsilon(0.1, 1.0, 1, 1e-5), rel=1e-9)
        client.cancel(again)


WIDTH = 64  # step k's one example is 0.5 on coordinate k % WIDTH: its release says which step it is


def test_sigkill_at_random_points_of_steps_leaves_each_step_released_once_as_the_trainer_got_it(tmp_path):
    """A trainer steps as fast as it can while the server is killed (SIGKILL) at random moments and restarted: the
    kills land before a step's aggregation is made, before its release is recorded and after (the answer lost).
    The trainer's retried calls go on; at the end the ledger holds exactly the trainer's steps, in order, each
    release the exact (noiseless) mean the trainer got, and no aggregation is left open (none holds a
    reservation)."""
    server = ServerProcess(tmp_path / "data", tmp_path / "cache", free_port())
    server.start()
    target = f"127.0.0.1:{server.port}"
    taken: list = []
    errors: list[BaseException] = []
    kills_done = threading.Event()

    def trainer(dp: DpSgd) -> None:
        try:
            k = 0
            while (not kills_done.is_set() or k < len(taken) + 3) and k < 4 * WIDTH:
                x = np.zeros((1, WIDTH), np.float32)
                x[0, k % WIDTH] = 0.5
                taken.append((k, dp.step({"w": x})))
                k += 1
        except BaseException as e:  # (reported by the test)
            errors.append(e)

    try:
        with Client(target, retry_timeout=120.0) as client:
            dp = DpSgd(client, {"w": (WIDTH,)}, l2_norm_clip=1.0, noise_multiplier=0.0, sampling_rate=0.5,
                       dataset_size=8, delta=1e-5)
            thread = threading.Thread(target=trainer, args=(dp,))
            thread.start()
            rng = random.Random(11)
            for _ in range(4):
                time.sleep(rng.uniform(0.05, 0.6))
                server.kill()
                server.start()
            kills_done.set()
            thread.join(240)
            assert not thread.is_alive() and not errors, errors
            ledger = client.ledger(dp.ledger_id)
            left = client.list_aggregations()
            dp.close()
    finally:
        server.stop()
    assert server.kills == 4 and len(taken) >= 3
    assert [e.aggregation_id for e in ledger.entries] == [step.aggregation_id for _, step in taken]
    for k, step in taken:
        expected = np.zeros(WIDTH, np.float32)
        expected[k % WIDTH] = 0.5 / (0.5 * 8)
        np.testing.assert_array_equal(step.gradient["w"], expected)
    # What a kill may leave: the step before's aggregation (its drop queued in the killed process), finalized.
    assert all(a.state == pb.Aggregation.FINALIZED for a in left), left
    assert {a.aggregation_id for a in left} <= {step.aggregation_id for _, step in taken}


def test_a_step_larger_than_a_message_goes_through_the_separate_calls_and_the_next_one_does_not():
    """The server takes messages of 1 MiB: a step of 2 MiB of gradients is refused by gRPC before anything of it is
    read (RESOURCE_EXHAUSTED, no retry hint) and goes through create, submit and finalize; the next, small step is
    one call again. Both are the exact noiseless mean."""
    server, port = create_server(Settings(**{**TEST_SETTINGS, "max_message_bytes": 1 << 20}))
    try:
        with Client(f"127.0.0.1:{port}", message_bytes=256 << 10) as client, \
                DpSgd(client, {"w": (1024,)}, l2_norm_clip=1.0, noise_multiplier=0.0, sampling_rate=0.5,
                      dataset_size=1024, delta=1e-5) as dp:
            steps = {}
            for rows in (64, 512, 64):  # 256 KiB, 2 MiB, 256 KiB of gradients
                x = np.full((rows, 1024), 0.5 / 32, np.float32)  # each row's norm 0.5: not clipped
                step = dp.step({"w": x})
                np.testing.assert_allclose(step.gradient["w"], rows * 0.5 / 32 / 512, rtol=1e-6)
                steps[len(steps)] = step
            assert [s.seconds["step"] > 0 for s in steps.values()] == [True, False, True]
            assert steps[1].seconds["finalize"] > 0 and client.steps_in_one_call
            assert len(client.ledger(dp.ledger_id).entries) == 3
    finally:
        server.stop(grace=1.0)


def test_a_one_call_step_commits_once_and_writes_no_checkpoint_and_the_separate_calls_do(served, monkeypatch):
    """A step's raw sums are never checkpointed (the trainer holds its gradients until the answer), and a step is
    one commit (SQLite's own trace of the store's connection): its record, its release, the ledger entry and the
    deletion of the step before. Three one-call steps after a first: 3 COMMITs, no checkpoint, and of its steps
    the store holds the last alone; the same steps through the separate calls write their checkpoints and commit more."""
    server, target = served
    store = server.servicer.lifecycle.store
    written, statements = [], []
    save = store.save_checkpoint
    monkeypatch.setattr(store, "save_checkpoint", lambda aggregation_id, *a, **k: (written.append(aggregation_id),
                                                                                    save(aggregation_id, *a, **k)))
    store._conn.set_trace_callback(statements.append)
    rng = np.random.default_rng(2)
    counts, commits = {}, {}
    try:
        with Client(target) as client:
            for one_call in (True, False):
                with DpSgd(client, LAYERS, l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=0.1,
                           dataset_size=50, delta=1e-5, one_call=one_call, pipeline=False) as dp:
                    dp.step(gradients(rng, 4))
                    written.clear()
                    statements.clear()
                    steps = {dp.step(gradients(rng, 4)).aggregation_id for _ in range(3)}
                    commits[one_call] = sum(sql.strip().upper() == "COMMIT" for sql in statements)
                    counts[one_call] = len(set(written) & steps)
                    if one_call:
                        kept = {r.aggregation_id for r in store.records()}
                        assert dp._last in kept and not (steps - {dp._last}) & kept
                        assert len(client.ledger(dp.ledger_id).entries) == 4
    finally:
        store._conn.set_trace_callback(None)
    assert counts == {True: 0, False: 3}
    assert commits[True] == 3 and commits[False] >= 3 * 4, commits  # (create, checkpoint, release, delete)
