"""Real training through clipd: Opacus (1.6, real) as the oracle of one step, the two DP-SGD examples
learning scikit-learn's digits against an embedded server, and the DpSgd helper's promises."""

from __future__ import annotations

import functools
import importlib
import json
import math
import pathlib
import subprocess
import sys
import warnings

import background
import numpy as np
import pytest
import torch
from conftest import TEST_SETTINGS
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant
from helpers import wait_until
from opacus import GradSampleModule
from opacus.accountants import RDPAccountant
from opacus.optimizers import DPOptimizer, DPPerLayerOptimizer
from torch import nn

from clipd.client import Client, FailedPreconditionError, NotFoundError
from clipd.client.dpsgd import DpSgd, poisson_sample
from clipd.client.updates import Layer, as_batch
from clipd.server.app import create_server
from clipd.server.settings import Settings

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """A server with the durable (SQLite) store, as a trainer would use it."""
    data_dir = tmp_path_factory.mktemp("clipd-training")
    server, port = create_server(Settings(**{**TEST_SETTINGS, "data_dir": str(data_dir), "max_device_rows": 64}))
    with Client(f"127.0.0.1:{port}") as client:
        yield client
    server.stop(grace=1.0)


def example(name: str):
    """An example script as a module (they import their shared ``dpsgd_common`` from examples/)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def rdp_epsilon(sampling_rate: float, noise_multiplier: float, steps: int, delta: float) -> float:
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dpe.PoissonSampledDpEvent(sampling_rate, dpe.GaussianDpEvent(noise_multiplier)), steps)
    return accountant.get_epsilon(delta)


# Opacus as the oracle of one step ---------------------------------------------------------------
def _opacus_step(per_layer: bool, clip: float, batch: int = 48, seed: int = 3):
    """A real Opacus step on the examples' MLP (noise 0, loss summed): the per-sample gradients its
    GradSampleModule computed, and the clipped sum its optimizer put into each ``p.grad``."""
    torch.manual_seed(seed)
    model = GradSampleModule(example("dpsgd_torch").Mlp(), loss_reduction="sum")
    params = [p for p in model.parameters()]
    k = len(params)
    if per_layer:
        optimizer = DPPerLayerOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=0.0,
                                        max_grad_norm=[clip / math.sqrt(k)] * k, expected_batch_size=batch,
                                        loss_reduction="sum")
    else:
        optimizer = DPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=0.0, max_grad_norm=clip,
                                expected_batch_size=batch, loss_reduction="sum")
    x = torch.rand(batch, 64) * torch.logspace(-1.5, 0.5, batch).unsqueeze(1)  # norms on both sides of C
    y = torch.randint(0, 10, (batch,))
    with warnings.catch_warnings():  # torch notes that the input needs no gradient: it doesn't
        warnings.simplefilter("ignore", UserWarning)
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    grad_samples = {name: p.grad_sample.detach().clone() for name, p in model.named_parameters()}
    assert optimizer.pre_step()  # clip, accumulate, add (zero) noise, scale: p.grad
    summed = {name: p.grad.detach().numpy().copy() for name, p in model.named_parameters()}
    return {name.removeprefix("_module."): g for name, g in grad_samples.items()}, \
        {name.removeprefix("_module."): s for name, s in summed.items()}


def _opacus_clip_counts(grad_samples: dict[str, torch.Tensor], bounds: dict[str, float] | float) -> dict[str, int]:
    """How many examples Opacus scales down, by its formula: factor = C / (norm + 1e-6), clamped to 1."""
    flat = {n: g.reshape(len(g), -1).norm(2, dim=-1) for n, g in grad_samples.items()}
    if isinstance(bounds, float):  # flat clipping: one norm over all layers
        total = torch.stack(list(flat.values()), dim=1).norm(2, dim=1)
        count = int((bounds / (total + 1e-6) < 1.0).sum())
        return {n: count for n in grad_samples}
    return {n: int((bounds[n] / (norms + 1e-6) < 1.0).sum()) for n, norms in flat.items()}


def _clipd_sum(client, grad_samples, policy: str, clip: float):
    layers = {name: tuple(g.shape[1:]) for name, g in grad_samples.items()}
    aggregation = client.create_aggregation(layers, policy=policy, l2_norm_clip=clip)
    client.submit(aggregation, grad_samples)  # the torch tensors as they are
    result = client.finalize(aggregation)
    client.cancel(aggregation)
    return result


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per_layer"])
def test_one_step_sums_what_opacus_clipping_sums_with_the_same_clip_counts(client, per_layer):
    clip = 2.0  # the examples' gradient norms spread from 1.1 to 6.4
    grad_samples, opacus_sums = _opacus_step(per_layer, clip)
    k = len(grad_samples)
    bounds = {n: clip / math.sqrt(k) for n in grad_samples} if per_layer else clip
    counts = _opacus_clip_counts(grad_samples, bounds)
    batch = len(next(iter(grad_samples.values())))
    assert sum(0 < c < batch for c in counts.values()) >= 2  # some examples clipped, some not: a real test
    result = _clipd_sum(client, grad_samples, "per_layer_uniform" if per_layer else "global", clip)
    assert result.clip_counts == counts
    for name, expected in opacus_sums.items():
        np.testing.assert_allclose(result.sums[name], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_the_opacus_parity_fails_with_another_clip_bound(client):
    """The negative control: the same gradients clipped to 1.2 C are not Opacus' step at C."""
    grad_samples, opacus_sums = _opacus_step(False, 2.0)
    result = _clipd_sum(client, grad_samples, "global", 2.4)
    assert result.clip_counts != _opacus_clip_counts(grad_samples, 2.0)
    assert not all(np.allclose(result.sums[n], s, rtol=1e-5, atol=1e-5 * np.abs(s).max())
                   for n, s in opacus_sums.items())


def test_a_noiseless_dpsgd_step_is_opacus_mean_over_the_expected_batch_size(client):
    """DpSgd's release divides by q * n as Opacus' optimizer does (loss_reduction="mean")."""
    grad_samples, opacus_sums = _opacus_step(False, 2.0, batch=48)
    layers = {name: tuple(g.shape[1:]) for name, g in grad_samples.items()}
    with DpSgd(client, layers, l2_norm_clip=2.0, noise_multiplier=0.0, sampling_rate=0.25, dataset_size=192,
               delta=1e-5) as dp:
        step = dp.step(grad_samples)
    assert step.release.noise_stddev == 0.0 and math.isinf(step.epsilon)  # no noise: no privacy, and said so
    for name, expected in opacus_sums.items():
        np.testing.assert_allclose(step.gradient[name], expected / 48, rtol=1e-5, atol=1e-7)


# The examples learn -----------------------------------------------------------------------------
EXAMPLE_RUNS = ["dpsgd_torch", "dpsgd_jax"]


def _example_run(name: str, out: pathlib.Path) -> subprocess.CompletedProcess:
    """``python examples/<name>.py --epochs 3`` (its embedded server), its plot and summary written to ``out``."""
    return background.run_process([sys.executable, str(EXAMPLES / f"{name}.py"), "--epochs", "3", "--quiet",
                                   "--seed-sampling", "--out", str(out)], 600, cwd=EXAMPLES)


def _example_job(name: str, config) -> background.Job:
    out = config._tmp_path_factory.mktemp(f"example-{name}")
    return background.Job(f"training:{name}", functools.partial(_example_run, name, out))


def background_jobs(items, config) -> list[background.Job]:
    """The selected example runs start once the tests are collected, beside the tests (tests/background.py)."""
    test = "test_the_example_learns_digits_through_clipd_at_the_epsilon_dp_accounting_gives"
    wanted = dict.fromkeys(item.callspec.params["name"] for item in items if item.originalname == test)
    return [_example_job(name, config) for name in wanted]


@pytest.mark.parametrize("name", EXAMPLE_RUNS)
def test_the_example_learns_digits_through_clipd_at_the_epsilon_dp_accounting_gives(name, request):
    """The example as a script (run beside the earlier tests): 3 epochs, the accounting of its summary."""
    run = background.job(f"training:{name}", functools.partial(_example_job, name, request.config)).result()
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    out = pathlib.Path(run.args[-1])
    summary = json.loads((out / f"{name}.json").read_text())
    assert summary["steps"] == 18  # 3 epochs of round(1,438 / 256) steps
    assert summary["accuracy"] > 0.6, summary["history"]  # chance is 0.1; about 0.88 at this point
    q = summary["sampling_rate"]
    assert q == pytest.approx(256 / 1438)
    assert summary["epsilon"] == pytest.approx(rdp_epsilon(q, 2.0, 18, 1e-5), rel=1e-9)
    opacus = RDPAccountant()
    opacus.history = [(2.0, q, 18)]
    assert summary["opacus_rdp_epsilon"] == pytest.approx(opacus.get_epsilon(1e-5), rel=1e-12)
    assert summary["opacus_rdp_epsilon"] == pytest.approx(summary["epsilon"], rel=1e-3)  # see docs/dp-sgd.md
    for record in summary["history"]:
        assert set(record["clip_fraction"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
        assert all(0.0 <= f <= 1.0 for f in record["clip_fraction"].values())
    assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert run.stdout.strip().splitlines()[-1].startswith(f"accuracy={summary['accuracy']:.4f} ")  # its last line


# The DpSgd helper ---------------------------------------------------------------------------------
def test_a_spent_budget_refuses_the_next_step_before_any_of_it_is_sent(client):
    layers = {"w": (4,)}
    rng = np.random.default_rng(0)
    one = rdp_epsilon(0.5, 1.0, 1, 1e-5)
    with DpSgd(client, layers, l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=0.5, dataset_size=8,
               delta=1e-5, max_epsilon=rdp_epsilon(0.5, 1.0, 3, 1e-5) * 1.0001) as dp:
        for _ in range(3):
            dp.step({"w": rng.standard_normal((4, 4)).astype(np.float32)})
        assert dp.epsilon > one
        with pytest.raises(FailedPreconditionError, match="budget"):
            dp.step({"w": rng.standard_normal((4, 4)).astype(np.float32)})
    ledger = client.ledger(dp.ledger_id)
    assert len(ledger.entries) == 3  # the refused step left nothing on the ledger
    assert ledger.epsilon == pytest.approx(rdp_epsilon(0.5, 1.0, 3, 1e-5), rel=1e-9)


def test_closing_cancels_the_aggregation_made_ahead(client):
    with DpSgd(client, {"w": (2,)}, l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=0.1, dataset_size=100,
               delta=1e-5, one_call=False) as dp:
        dp.step({"w": np.ones((3, 2), np.float32)})
        ahead = dp._next.result()
        assert client.get_aggregation(ahead).state in (1, 2)  # WARMING_UP or OPEN: its release reserved
    with pytest.raises(NotFoundError):  # cancelled before any batch: gone
        client.get_aggregation(ahead)
    assert len(client.ledger(dp.ledger_id).entries) == 1
    # A new release on the ledger plans for the committed step and itself, no reservation left over.
    again = client.create_aggregation({"w": (2,)}, l2_norm_clip=1.0, privacy=dp.privacy)
    assert client.get_aggregation(again).planned_ledger_epsilon == pytest.approx(
        rdp_epsilon(0.1, 1.0, 2, 1e-5), rel=1e-9)
    client.cancel(again)


@pytest.mark.parametrize("one_call", [True, False])
def test_steps_leave_no_aggregation_behind(client, one_call):
    """Each finished step's aggregation is dropped in the background (by the server after the next step's call,
    or by the pipelined trainer), the last one by closing: soon none of them is left."""
    with DpSgd(client, {"w": (2,)}, l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=0.1, dataset_size=100,
               delta=1e-5, one_call=one_call) as dp:
        steps = [dp.step({"w": np.ones((3, 2), np.float32)}).aggregation_id for _ in range(3)]
    assert len(set(steps)) == 3
    wait_until(lambda: not set(steps) & {a.aggregation_id for a in client.list_aggregations()}, 10,
               "every step's aggregation dropped", step=0.05)
    assert len(client.ledger(dp.ledger_id).entries) == 3  # their releases stay on the ledger


def test_a_failed_step_leaves_no_reservation_on_the_ledger(client):
    """Gradients of the wrong shape fail the step before anything is sent; the step's aggregation goes."""
    from clipd.client import InvalidUpdateError

    with DpSgd(client, {"w": (2,)}, l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=0.1, dataset_size=100,
               delta=1e-5, pipeline=False) as dp:
        dp.step({"w": np.ones((3, 2), np.float32)})
        with pytest.raises(InvalidUpdateError):
            dp.step({"w": np.ones((3, 5), np.float32)})
        planned = []  # what the ledger plans for one more step

        def planned_epsilon() -> float:
            again = client.create_aggregation({"w": (2,)}, l2_norm_clip=1.0, privacy=dp.privacy)
            planned.append(client.get_aggregation(again).planned_ledger_epsilon)
            client.cancel(again)
            return planned[-1]

        # The cancel runs in the background; then one more step plans 1 committed + itself.
        wait_until(lambda: planned_epsilon() == pytest.approx(rdp_epsilon(0.1, 1.0, 2, 1e-5), rel=1e-9), 10,
                   lambda: f"the failed step's reservation gone (planned epsilon {planned[-1]})", step=0.05)
        assert dp.step({"w": np.ones((3, 2), np.float32)}).epsilon == pytest.approx(
            rdp_epsilon(0.1, 1.0, 2, 1e-5), rel=1e-9)


def test_an_empty_poisson_sample_is_a_step_of_noise_alone(client):
    with DpSgd(client, {"w": (2,)}, l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=0.01, dataset_size=10,
               delta=1e-5, pipeline=False) as dp:
        step = dp.step({"w": np.zeros((0, 2), np.float32)})
    assert step.examples == 0 and step.seconds["submit"] == 0.0
    assert np.all(step.gradient["w"] != 0.0)  # noised
    assert step.epsilon == pytest.approx(rdp_epsilon(0.01, 1.0, 1, 1e-5), rel=1e-9)


def test_torch_tensors_go_into_the_client_without_a_copy():
    layers = [Layer("w", (3,), "float32")]
    gradients = torch.randn(5, 3)
    assert np.shares_memory(as_batch([gradients], layers)[0], gradients.numpy())
    tracked = torch.randn(5, 3, requires_grad=True) * 2  # part of an autograd graph: detached, not refused
    np.testing.assert_array_equal(as_batch([tracked], layers)[0], tracked.detach().numpy())


def test_poisson_sampling_draws_each_example_with_probability_q():
    rng = np.random.default_rng(5)
    sizes = [len(poisson_sample(1000, 0.1, rng)) for _ in range(400)]
    assert np.mean(sizes) == pytest.approx(100, rel=0.02)
    assert np.std(sizes) == pytest.approx(math.sqrt(1000 * 0.1 * 0.9), rel=0.15)  # binomial, not fixed-size


@pytest.mark.parametrize(("clipping", "lines"), [("flat", 1), ("per_layer", 2)])
def test_the_plot_draws_one_clip_fraction_line_under_flat_clipping(clipping, lines, tmp_path, monkeypatch):
    """Flat clipping: every layer's fraction is one quantity, so one line (their mean); per-layer: a line each."""
    import argparse

    from matplotlib import pyplot as plt

    common = example("dpsgd_common")
    history = [common.Epoch(e, 6 * e, 0.5 * e, 0.8, {"a": 0.2 * e, "b": 0.4 * e}, 1.0) for e in (1, 2)]
    drawn = []
    monkeypatch.setattr(plt, "close", lambda fig: drawn.append(fig))
    args = argparse.Namespace(delta=1e-5, noise_multiplier=2.0, clip=1.0, clipping=clipping)
    common.write_plot(tmp_path / "p.png", history, "torch", args)
    right = drawn[0].axes[1]
    assert len(right.lines) == lines
    if clipping == "flat":
        assert list(right.lines[0].get_ydata()) == pytest.approx([0.3, 0.6])  # the mean of the two layers
