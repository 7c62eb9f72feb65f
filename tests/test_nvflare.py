"""clipd as the aggregator of NVIDIA FLARE's FedAvg (clipd.client.nvflare), through NVFlare's simulator and a real
clipd server: the rounds' models against numpy and NVFlare's own FedAvg aggregation, a site that fails, bad input,
the example's private run against dp_accounting, and a clipd server that is down.

The two simulator jobs run once, one after the other (NVFlare's simulator gives a site's process 60 s to connect:
two jobs at once on 2 cores can miss that), against a ``clipd serve`` process; they start beside the earlier tests
once the tests are collected (tests/background.py), and the module fixture waits for them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys

import background
import conftest
import numpy as np
import pytest
import torch
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant
from service_helpers import free_port, like_test_settings

pytest.importorskip("nvflare", reason="the [nvflare] extra (scripts/test.sh installs it)")

import nvflare_site  # noqa: E402  (tests/nvflare_site.py: the known updates)
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType  # noqa: E402
from nvflare.app_common.aggregators.weighted_aggregation_helper import WeightedAggregationHelper  # noqa: E402

from clipd.client import Client, Privacy  # noqa: E402
from clipd.client.nvflare import ClipdAggregator  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE_ROUNDS, EXAMPLE_Z, EXAMPLE_DELTA, EXAMPLE_BUDGET = 5, 0.1, 1e-3, 220.0  # the 4th release would pass it


def _run(command: list[str], cwd: pathlib.Path, timeout: float = 100.0) -> subprocess.CompletedProcess | None:
    """Runs a simulator job in a process group of its own: its result, or None (the group killed) after
    ``timeout``: NVFlare's simulator now and then starts a site whose process never connects (its log: "Failed
    to create connection to the child process"), and then waits for that site for ever."""
    job = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)  # (cwd: the job's workspace, read by the tests)
    background.lower_priority(job)
    try:
        with background.tracked(job, kill=lambda: _kill_processes(job, cwd)):  # (if the session ends first)
            out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_job(job, cwd)
        return None
    done = subprocess.CompletedProcess(command, job.returncode, out, err)
    done.cwd = cwd  # type: ignore[attr-defined]
    return done


def _kill_job(job: subprocess.Popen, workspace: pathlib.Path) -> None:
    """Kills a hung job whole. The simulator runs in a process group of its own (NVFlare's), and its
    processes hold the job's pipes: killing the job's group leaves them, and reading the pipes to their end
    would wait for ever. So every process whose command line names the job's workspace is killed too."""
    _kill_processes(job, workspace)
    try:
        job.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # a process we could not find holds the pipes: stop reading them
        for pipe in (job.stdout, job.stderr):
            if pipe is not None:
                pipe.close()
        job.wait(10)


def _kill_processes(job: subprocess.Popen, workspace: pathlib.Path) -> None:
    """SIGKILL to the job's process group and to every process whose command line names its workspace."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    for process in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            named = str(workspace) in (process / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if named:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(process.name), signal.SIGKILL)


def _twice(run) -> subprocess.CompletedProcess | None:
    """``run(attempt)``, again once if the simulator hung (see :func:`_run`)."""
    return run(0) or run(1)


def _known_job(target: str, workspace: pathlib.Path, attempt: int) -> subprocess.CompletedProcess | None:
    """3 sites of tests/nvflare_site.py, 3 rounds, C = 1, no noise, each site submitting its update to clipd itself
    (``sites_submit``); run in a process of its own."""
    workspace = workspace / str(attempt)
    workspace.mkdir()
    code = f"""
import sys
sys.path.insert(0, {str(ROOT / 'tests')!r})
from nvflare.client.config import TransferType
from nvflare.recipe import SimEnv
from clipd.client.nvflare import ClipdFedAvgRecipe
import nvflare_site
recipe = ClipdFedAvgRecipe(name="known", min_clients=3, num_rounds=3, model=nvflare_site.TinyNet(),
                           train_script={str(ROOT / 'tests' / 'nvflare_site.py')!r}, clipd_target={target!r},
                           clipping_norm=1.0, params_transfer_type=TransferType.FULL, clipd_options={{"timeout": 60.0}},
                           sites_submit=True, site_options={{"timeout": 60.0}})
recipe.execute(SimEnv(num_clients=3, workspace_root={str(workspace)!r}))
"""
    return _run([sys.executable, "-c", code], workspace)


def _inline_job(target: str, workspace: pathlib.Path, attempt: int) -> subprocess.CompletedProcess | None:
    """NVFlare's plain FedAvg as a new user writes it: the initial model inline (a dict of arrays), no persistor,
    FULL models from the sites (FedAvg's default), ClipdAggregator; 3 sites of tests/nvflare_site.py, round 0 only."""
    workspace = workspace / str(attempt)
    workspace.mkdir()
    code = f"""
import sys
sys.path.insert(0, {str(ROOT / 'tests')!r})
from nvflare.app_common.workflows.fedavg import FedAvg
from nvflare.client.config import TransferType
from nvflare.fuel.utils.constants import FrameworkType
from nvflare.job_config.api import FedJob
from nvflare.job_config.script_runner import ScriptRunner
from clipd.client.nvflare import ClipdAggregator
import nvflare_site
model = {{k: v.detach().numpy().tolist() for k, v in nvflare_site.TinyNet().state_dict().items()}}  # (JSON: the job config)
job = FedJob(name="inline", min_clients=3)
job.to_server(FedAvg(num_clients=3, num_rounds=1, model=model, persistor_id="",
                     aggregator=ClipdAggregator({target!r}, 3, clipping_norm=1.0, timeout=60.0)))
for site in ("site-1", "site-2", "site-3"):
    job.to(ScriptRunner(script={str(ROOT / 'tests' / 'nvflare_site.py')!r}, framework=FrameworkType.NUMPY,
                        params_transfer_type=TransferType.FULL), site)
job.simulator_run({str(workspace)!r}, threads=3)
"""
    return _run([sys.executable, "-c", code], workspace)


def _example(target: str, workspace: pathlib.Path, attempt: int) -> subprocess.CompletedProcess | None:
    workspace = workspace / str(attempt)
    workspace.mkdir()
    return _run(
        [sys.executable, str(ROOT / "examples" / "nvflare" / "job.py"), "--rounds", str(EXAMPLE_ROUNDS),
         "--noise-multiplier", str(EXAMPLE_Z), "--delta", str(EXAMPLE_DELTA), "--max-epsilon", str(EXAMPLE_BUDGET),
         "--local-epochs", "3", "--lr", "0.5", "--target", target, "--workspace", str(workspace),
         "--ledger", f"nvflare-example-{attempt}"], workspace)


def _jobs(tmp_path_factory) -> dict:
    """A ``clipd serve`` (the settings of TEST_SETTINGS) and the two simulator jobs against it, one after the
    other; the server is left running for the tests (stopped by the fixture, or at the end of the session)."""
    server = like_test_settings(tmp_path_factory.mktemp("clipd"))
    server.start()
    background.at_session_end(server.stop)
    known, example = tmp_path_factory.mktemp("known"), tmp_path_factory.mktemp("example")
    inline = tmp_path_factory.mktemp("inline")
    target = f"127.0.0.1:{server.port}"
    known_run = _twice(lambda attempt: _known_job(target, known, attempt))
    inline_run = _twice(lambda attempt: _inline_job(target, inline, attempt))
    example_run = _twice(lambda attempt: _example(target, example, attempt))
    return {"known": known_run.cwd if known_run else known, "known_run": known_run,
            "inline": inline_run.cwd if inline_run else inline, "inline_run": inline_run,
            "example": example_run.cwd if example_run else example, "example_run": example_run, "target": target,
            "server": server}


def _jobs_job(config) -> background.Job:
    return background.Job("nvflare:jobs", functools.partial(_jobs, config._tmp_path_factory))


def background_jobs(items, config) -> list[background.Job]:
    """The simulator jobs start once the tests are collected, beside the tests (tests/background.py)."""
    return [_jobs_job(config)] if any("jobs" in item.fixturenames for item in items) else []


@pytest.fixture(scope="module")
def jobs(request):
    """The two simulator jobs' runs (started beside the earlier tests; run now if they were not)."""
    done = background.job("nvflare:jobs", functools.partial(_jobs_job, request.config)).result()
    yield done
    done["server"].stop()


def _saved_model(workspace: pathlib.Path) -> dict[str, np.ndarray]:
    saved = sorted(workspace.rglob("FL_global_model.pt"), key=lambda p: p.stat().st_mtime)
    assert saved, f"no model saved under {workspace}"
    state = torch.load(saved[-1], map_location="cpu", weights_only=False)
    state = state.get("model", state)
    return {k: np.asarray(v, dtype=np.float64) for k, v in state.items()}


def _server_log(workspace: pathlib.Path) -> str:
    return "\n".join(p.read_text() for p in workspace.rglob("log.txt") if "server" in p.parts)


def _clipped(update: dict[str, np.ndarray], bound: float) -> dict[str, np.ndarray]:
    norm = np.sqrt(sum(float(np.sum(u * u)) for u in update.values()))
    return {k: u * min(1.0, bound / norm) for k, u in update.items()}


def test_rounds_equal_fedavg_under_the_bound_and_the_clipped_mean_over_m_above_it(jobs):
    """Round 0 (every update under C): NVFlare's own FedAvg aggregation with equal weights (its
    WeightedAggregationHelper, float64). Round 1 (over C; site-3 fails): the numpy mean of the clipped updates of
    sites 1 and 2, divided by m = 3. Round 2 (bad input from every site): the model unchanged. Each site submits
    its update to clipd itself: NVFlare's server gets receipts."""
    start = {k: v.detach().double().numpy() for k, v in nvflare_site.TinyNet().state_dict().items()}
    fedavg = WeightedAggregationHelper()
    for site in (1, 2, 3):
        fedavg.add({k: v.astype(np.float64) for k, v in nvflare_site.update(site, 0).items()}, 1.0, f"site-{site}", 0)
    round0 = fedavg.get_result()
    round1 = {k: (_clipped(nvflare_site.update(1, 1), 1.0)[k] + _clipped(nvflare_site.update(2, 1), 1.0)[k]) / 3
              for k in start}
    expected = {k: start[k] + round0[k] + round1[k] for k in start}
    assert jobs["known_run"] is not None, "NVFlare's simulator hung twice"
    saved = _saved_model(jobs["known"])
    assert saved.keys() == expected.keys(), _server_log(jobs["known"])[-3000:]
    for k in expected:
        np.testing.assert_allclose(saved[k], expected[k], rtol=1e-6, atol=1e-7)
    log = _server_log(jobs["known"])
    assert "clipd: round 1 released from 2 of m = 3 sites" in log
    assert all(f"clipd: round {r}: site-{s} submitted its update to clipd itself" in log
               for r, s in ((0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (2, 2)))
    assert re.search(r"round 2: the update of site-1 was not taken by clipd \(.*fc\.weight", log)
    assert "clipd: round 2 released from 1 of m = 3 sites" in log  # site-2's NaN: zeroed, counted


def test_plain_fedavg_with_an_inline_model_and_full_updates_is_fedavg_under_the_bound(jobs):
    """NVFlare's own FedAvg(model=<dict>, persistor_id="", aggregator=ClipdAggregator(...)), sites sending FULL
    models: the aggregator learns the global model from the training task FedAvg sends, so round 0 (every update
    under C, z = 0) is NVFlare's own FedAvg aggregation with equal weights (its WeightedAggregationHelper), every
    site's update in it."""
    from nvflare.fuel.utils import fobs

    start = {k: v.detach().double().numpy() for k, v in nvflare_site.TinyNet().state_dict().items()}
    fedavg = WeightedAggregationHelper()
    for site in (1, 2, 3):
        fedavg.add({k: v.astype(np.float64) for k, v in nvflare_site.update(site, 0).items()}, 1.0, f"site-{site}", 0)
    round0 = fedavg.get_result()
    assert jobs["inline_run"] is not None, "NVFlare's simulator hung twice"
    saved = sorted(jobs["inline"].rglob("FL_global_model.pt"), key=lambda p: p.stat().st_mtime)
    log = _server_log(jobs["inline"])
    assert saved, f"no model saved: {log[-3000:]}"
    params = fobs.loadf(str(saved[-1])).params
    assert params.keys() == start.keys(), log[-3000:]
    for k in start:
        np.testing.assert_allclose(np.asarray(params[k], np.float64), start[k] + round0[k], rtol=1e-6, atol=1e-7)
    assert "clipd: round 0 released from 3 of m = 3 sites" in log, log[-3000:]
    assert "global model is not known" not in log


def test_the_example_reaches_its_accuracy_and_its_epsilons_are_dp_accountings(jobs):
    """The digits example, private (z = 0.1 on the sum of 3 sites' clipped updates): each round's ledger epsilon is
    dp_accounting's for that many Gaussian releases, the job stops at the round that would pass max_epsilon (with a
    message in NVFlare's log) and its last model is the last released one."""
    run = jobs["example_run"]
    assert run is not None, "NVFlare's simulator hung twice"
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    found = re.fullmatch(r"nvflare: rounds=(\d+) accuracy=([0-9.]+) epsilon=([0-9.]+)", last)
    assert found, last
    rounds, accuracy, epsilon = int(found[1]), float(found[2]), float(found[3])
    epsilons = []
    for k in range(1, EXAMPLE_ROUNDS + 1):
        accountant = rdp_privacy_accountant.RdpAccountant()
        accountant.compose(dpe.GaussianDpEvent(EXAMPLE_Z), k)
        epsilons.append(accountant.get_epsilon(EXAMPLE_DELTA))
    affordable = sum(e <= EXAMPLE_BUDGET for e in epsilons)
    assert 0 < affordable < EXAMPLE_ROUNDS  # (the budget stops the job early)
    assert rounds == affordable and epsilon == pytest.approx(epsilons[affordable - 1], rel=1e-6)
    with Client(jobs["target"]) as client:
        ledger = client.ledger(run.args[-1])
    assert [e.epsilon_after for e in ledger.entries] == pytest.approx(epsilons[:affordable], rel=1e-6)
    log = _server_log(jobs["example"])
    assert f"clipd: training stops at round {affordable}" in log and "budget" in log
    assert f"no site trains in round {affordable}" in log
    lines = log.splitlines()
    saved = [i for i, line in enumerate(lines) if "End persist model on server" in line]
    stop = next(i for i, line in enumerate(lines) if f"clipd: training stops at round {affordable}" in line)
    assert len(saved) == affordable and saved[-1] < stop  # the last model saved is the last one released
    assert accuracy >= 0.6, run.stdout[-2000:]


def _aggregator(target: str, retry_timeout: float = 60.0) -> ClipdAggregator:
    return ClipdAggregator(target, num_sampled_clients=3, clipping_norm=10.0, timeout=10.0,
                           retry_timeout=retry_timeout)


def _diff(site: str, params: dict) -> FLModel:
    return FLModel(params_type=ParamsType.DIFF, params=params, meta={"client_name": site})


def test_nan_is_zeroed_and_counted_and_a_bad_site_takes_nothing_from_the_others(server, caplog):
    """Driven as FedAvg drives it (reset_stats, accept_model per site, aggregate_model), without a global model in
    its context: an update with NaN counts as zero, one of another shape or without a layer contributes nothing
    (logged), and the mean of the good update is divided by m = 3."""
    caplog.set_level(logging.INFO)
    aggregator = _aggregator(f"127.0.0.1:{server.port}")
    good = {"w": np.array([1.0, 2.0, 3.0], np.float32), "b": np.array([0.5], np.float32)}
    aggregator.reset_stats()
    aggregator.accept_model(_diff("site-1", good))
    aggregator.accept_model(_diff("site-2", {"w": np.array([np.nan, 1.0, 1.0], np.float32), "b": good["b"]}))
    aggregator.accept_model(_diff("site-3", {"w": np.ones(4, np.float32), "b": good["b"]}))
    aggregator.accept_model(_diff("site-4", {"w": good["w"]}))
    result = aggregator.aggregate_model()
    assert result.params_type == ParamsType.DIFF
    np.testing.assert_allclose(result.params["w"], good["w"] / 3, rtol=1e-6)
    np.testing.assert_allclose(result.params["b"], good["b"] / 3, rtol=1e-6)  # (site-2's whole update is zeroed)
    text = caplog.text
    assert "site-3: array 'w' has shape (4,), the model (3,)" in text
    assert "site-4 does not hold the model's arrays" in text
    assert result.meta["clipd"]["released"] is True


def test_a_clipd_server_that_is_down_leaves_the_model_unchanged_with_a_message(caplog):
    caplog.set_level(logging.INFO)
    target = f"127.0.0.1:{free_port()}"
    aggregator = _aggregator(target, retry_timeout=1.0)  # (it retries a restarting server a while)
    aggregator.reset_stats()
    aggregator.accept_model(_diff("site-1", {"w": np.ones(3, np.float32)}))
    result = aggregator.aggregate_model()
    assert result.params_type == ParamsType.DIFF and result.params == {}  # FedAvg adds nothing
    assert f"can't be opened on {target}" in caplog.text and "the global model is unchanged" in caplog.text


def test_its_arguments_are_builtins_as_nvflare_rebuilds_it_on_its_server():
    """NVFlare writes an aggregator's arguments into the job's configuration and builds it again from them."""
    from nvflare.job_config.fed_job_config import FedJobConfig

    privacy = Privacy("ledger-x", 1e-5, noise_multiplier=1.2, max_epsilon=4.0)
    aggregator = ClipdAggregator("clipd:50051", num_sampled_clients=5, clipping_norm=0.5, privacy=privacy)
    args = FedJobConfig(job_name="x", min_clients=1)._get_args(aggregator, "/tmp")
    rebuilt = ClipdAggregator(**args)
    assert rebuilt.target == "clipd:50051" and rebuilt.num_sampled_clients == 5 and rebuilt.clipping_norm == 0.5
    assert rebuilt.privacy == aggregator.privacy and rebuilt.privacy["max_epsilon"] == 4.0


def test_sites_clipd_does_not_draw_neither_train_nor_send(auth_server, monkeypatch, caplog):
    """A ledger whose sampling the server draws (q = 0.5, z = 0: the sum exact): ClipdFedAvg sends training to the
    sites drawn among those FedAvg sampled, and the aggregator sends the updates of drawn sites only (another
    site's is logged and left out); the release is the drawn sites' mean over m."""
    from nvflare.app_common.workflows.fedavg import FedAvg

    from clipd.client.nvflare import ClipdFedAvg

    caplog.set_level(logging.INFO)
    privacy = Privacy(f"flare-drawn-{os.getpid()}", 1e-5, noise_multiplier=0.0, sampling="poisson",
                      sampling_rate=0.5, drawn_by="server")
    aggregator = ClipdAggregator(f"127.0.0.1:{auth_server.port}", num_sampled_clients=10, clipping_norm=10.0,
                                 privacy=privacy, token=conftest.ADMIN_TOKEN, timeout=10.0)
    sites = [f"site-{i}" for i in range(20)]
    update = {"w": np.full(3, 0.5, np.float32)}
    aggregator.reset_stats()  # (no global model in its context: the round opens with the first update)
    aggregator.accept_model(_diff(sites[0], update))
    drawn = aggregator.drawn(sites)
    assert 0 < len(drawn) < len(sites) and drawn == [s for s in sites if s in drawn]
    sent: list = []
    monkeypatch.setattr(FedAvg, "send_model", lambda self, *args, **kwargs: sent.append(kwargs["targets"]))
    controller = ClipdFedAvg(num_clients=20, num_rounds=1, aggregator=aggregator)
    controller.current_round = 1
    controller.send_model(task_name="train", targets=sites, data=None, callback=None)
    assert sent == [drawn]
    for site in sites[1:]:
        aggregator.accept_model(_diff(site, update))
    result = aggregator.aggregate_model()
    np.testing.assert_allclose(result.params["w"], 0.5 * len(drawn) / 10, rtol=1e-6)
    left_out = next(s for s in sites if s not in drawn)
    assert f"{left_out} was not drawn for this round's release: its update is not sent" in caplog.text


def test_a_full_update_without_the_global_model_releases_the_round_from_none_of_its_updates(server, caplog):
    """No global model in the aggregator's context (no persistor, no training task seen): after a DIFF, a FULL
    update can't be made a difference, so the round releases nothing (said in the log), not the other updates over
    m; its aggregation is dropped, and the next round is released as usual."""
    caplog.set_level(logging.INFO)
    aggregator = _aggregator(f"127.0.0.1:{server.port}")
    good = {"w": np.array([1.0, 2.0, 3.0], np.float32)}
    aggregator.reset_stats()
    aggregator.accept_model(_diff("site-1", good))
    opened = aggregator.rounds.open_round.aggregation_id
    aggregator.accept_model(FLModel(params_type=ParamsType.FULL, params=good, meta={"client_name": "site-2"}))
    aggregator.accept_model(_diff("site-3", good))
    result = aggregator.aggregate_model()
    assert result.params == {} and result.meta["clipd"]["released"] is False
    assert "the update of site-2 is a FULL model and the global model is not known here" in caplog.text
    assert "the update of site-3 is not sent" in caplog.text and "round 1 not released" in caplog.text
    with Client(f"127.0.0.1:{server.port}") as client:
        assert opened not in {a.aggregation_id for a in client.list_aggregations()}
    aggregator.reset_stats()
    aggregator.accept_model(_diff("site-1", good))
    again = aggregator.aggregate_model()
    np.testing.assert_allclose(again.params["w"], good["w"] / 3, rtol=1e-6)


def test_the_training_task_makes_the_global_model_known_for_full_updates_after_a_diff(server, caplog):
    """No global model in the context. A DIFF opens the round (the model unknown: nothing of it needed); then the
    training task FedAvg sends goes out (``BEFORE_TRAIN_TASK``, the model in it), and a FULL update is made its
    difference from that model: the round is the mean of both updates over m = 3."""
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.app_constant import AppConstants
    from nvflare.app_common.app_event_type import AppEventType
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    caplog.set_level(logging.INFO)
    aggregator = _aggregator(f"127.0.0.1:{server.port}")
    current = {"w": np.array([10.0, 20.0, 30.0], np.float32)}
    u1, u2 = np.array([1.0, 2.0, 3.0], np.float32), np.array([0.5, -1.0, 0.25], np.float32)
    aggregator.reset_stats()  # (round 1: no context says otherwise)
    aggregator.accept_model(_diff("site-1", {"w": u1}))
    task = FLContext()
    task.set_prop(AppConstants.TRAIN_SHAREABLE,
                  FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params=current, current_round=1)))
    aggregator.handle_event(AppEventType.BEFORE_TRAIN_TASK, task)
    aggregator.accept_model(FLModel(params_type=ParamsType.FULL, params={"w": current["w"] + u2},
                                    meta={"client_name": "site-2"}))
    result = aggregator.aggregate_model()
    assert result.meta["clipd"]["released"] is True
    np.testing.assert_allclose(result.params["w"], (u1 + u2) / 3, rtol=1e-6)
    assert "global model is not known" not in caplog.text


def _site_filter(site: str, target: str, token: str | None, shareable, direction: str, context=None):
    """A site's ClipdSiteSubmitter run as NVFlare's client runner runs it: the task data in, then the result out,
    in one task context (the filter's state between the two)."""
    from nvflare.apis.fl_constant import FLContextKey, ReservedKey
    from nvflare.apis.fl_context import FLContext

    from clipd.client.nvflare import ClipdSiteSubmitter

    context = context if context is not None else FLContext()
    context.set_prop(ReservedKey.IDENTITY_NAME, site, private=False, sticky=True)
    context.set_prop(FLContextKey.FILTER_DIRECTION, direction, private=True, sticky=False)
    return ClipdSiteSubmitter(target, token=token, timeout=10.0).process(shareable, context), context


def test_sites_submit_their_own_updates_under_their_own_credentials_and_nvflare_carries_receipts(auth_server,
                                                                                                   caplog):
    """``sites_submit``: the training task names the round's aggregation; each site's filter submits its update to
    clipd under the site's own client token (a DIFF as it is, a FULL model less the task's model) and passes on a
    receipt alone. The release is the mean of both updates over m = 3 (z = 0); a site holding another site's token
    is refused by clipd under its own name (and logged); a receipt for another aggregation is not counted; a task
    that names no aggregation passes its result through as it is."""
    from nvflare.apis.fl_constant import FilterKey
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.app_constant import AppConstants
    from nvflare.app_common.app_event_type import AppEventType
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    from clipd.client.nvflare import RECEIPT, ROUND_HEADER

    caplog.set_level(logging.INFO)
    target = f"127.0.0.1:{auth_server.port}"
    ledger = f"flare-sites-submit-{os.getpid()}"
    aggregator = ClipdAggregator(target, num_sampled_clients=3, clipping_norm=100.0, token=conftest.ADMIN_TOKEN,
                                 privacy=Privacy(ledger, 1e-5, noise_multiplier=0.0), timeout=10.0,
                                 sites_submit=True)
    with Client(target, token=conftest.ADMIN_TOKEN) as admin:
        tokens = {site: admin.client_token(site, ledger=ledger) for site in ("site-1", "site-2")}
    current = {"w": np.array([10.0, 20.0, 30.0], np.float32), "b": np.array([1.0], np.float32)}
    u1 = {"w": np.array([1.0, 2.0, 3.0], np.float32), "b": np.array([0.5], np.float32)}
    u2 = {"w": np.array([0.5, -1.0, 0.25], np.float32), "b": np.array([-2.0], np.float32)}
    aggregator.reset_stats()
    task = FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params=current, current_round=1))
    sent = FLContext()
    sent.set_prop(AppConstants.TRAIN_SHAREABLE, task)
    aggregator.handle_event(AppEventType.BEFORE_TRAIN_TASK, sent)  # (the round opens: the model is known here)
    header = task.get_header(ROUND_HEADER)
    assert header == {"aggregation_id": aggregator.rounds.open_round.aggregation_id, "round": 1}

    replies = {}
    for site, token, model in (("site-1", tokens["site-1"], FLModel(params_type=ParamsType.DIFF, params=u1)),
                               ("site-2", tokens["site-2"], FLModel(params_type=ParamsType.FULL, params={
                                   k: current[k] + u2[k] for k in current})),
                               ("site-3", tokens["site-1"], FLModel(params_type=ParamsType.DIFF, params=u2))):
        _, context = _site_filter(site, target, token, task, FilterKey.IN)
        out, _ = _site_filter(site, target, token, FLModelUtils.to_shareable(model), FilterKey.OUT, context)
        replies[site] = FLModelUtils.from_shareable(out)
        assert set(replies[site].params) == {RECEIPT}  # nothing of the update goes to NVFlare's server
        aggregator.accept_model(FLModel(params_type=replies[site].params_type, params=replies[site].params,
                                        meta={**replies[site].meta, "client_name": site}))
    assert replies["site-1"].meta["clipd"]["submitted"] and replies["site-2"].meta["clipd"]["submitted"]
    assert "it may not submit as 'site-3'" in replies["site-3"].meta["clipd"]["error"]
    stale = {"aggregation_id": "nvflare-r0-elsewhere", "submitted": True}  # (a receipt of another round: not counted)
    aggregator.accept_model(FLModel(params_type=ParamsType.DIFF, params={RECEIPT: np.zeros(1, np.float32)},
                                    meta={"client_name": "site-4", "clipd": stale}))
    result = aggregator.aggregate_model()
    assert result.meta["clipd"]["released"] is True
    for k in current:
        np.testing.assert_allclose(result.params[k], (u1[k] + u2[k]) / 3, rtol=1e-6)
    assert "site-1 submitted its update to clipd itself" in caplog.text
    assert "clipd: round 1: the update of site-3 was not taken by clipd" in caplog.text
    assert "released from 2 of m = 3 sites" in caplog.text
    assert "the receipt of site-4 is for aggregation 'nvflare-r0-elsewhere', not round 1's" in caplog.text

    bare = FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params=current, current_round=2))
    _, context = _site_filter("site-1", target, tokens["site-1"], bare, FilterKey.IN)  # (no header: not ours)
    out, _ = _site_filter("site-1", target, tokens["site-1"],
                          FLModelUtils.to_shareable(FLModel(params_type=ParamsType.DIFF, params=u1)), FilterKey.OUT,
                          context)
    assert set(FLModelUtils.from_shareable(out).params) == {"w", "b"}
