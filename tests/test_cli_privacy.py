"""``clipd demo`` with differential privacy, run as a real subprocess against a real server.

The demos run beside the earlier tests (tests/background.py), one after the other, against one ``clipd serve``
process; each test checks its demo's output against the oracle.
"""

from __future__ import annotations

import functools
import re
import sys

import background
import pytest
from conftest import jax_cache_dir
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant
from service_helpers import like_test_settings

LAST_LINE = re.compile(r"^epsilon=(\S+) delta=(\S+) rounds=(\d+) noise_stddev=(\S+)$")

# Each test's demo: its flags (after --target and --examples 400).
DEMOS = {
    "test_private_demo_reports_the_ledgers_epsilon": (
        "--noise-multiplier", "1.1", "--sampling-rate", "0.05", "--delta", "1e-6", "--rounds", "4", "--clip", "0.5"),
    "test_private_demo_stops_when_the_budget_is_exhausted": (
        "--noise-multiplier", "1.0", "--rounds", "5", "--max-epsilon", "8"),
    "test_private_demo_with_secure_noise_spends_opendps_zcdp_epsilon": (
        "--noise-multiplier", "1.5", "--rounds", "3", "--clip", "0.5", "--secure-noise"),
    "test_private_demo_with_a_blt_stream_spends_one_gaussian_event": (
        "--noise-multiplier", "1.0", "--rounds", "3", "--mechanism", "blt"),
}


def _run_demos(tmp_path_factory, wanted: list[str]) -> dict:
    """A ``clipd serve`` (the settings of TEST_SETTINGS) and the ``wanted`` tests' demos against it, in turn."""
    # The tests' JAX cache: the BLT test's oracle reads jax_privacy's optimizer programs that the server compiled.
    server = like_test_settings(tmp_path_factory.mktemp("cli-privacy"), cache_dir=jax_cache_dir())
    try:
        server.start()
        background.at_session_end(server.stop)
        return {name: background.run_process(
            [sys.executable, "-m", "clipd", "demo", "--target", f"127.0.0.1:{server.port}", "--examples", "400",
             *DEMOS[name]], 300) for name in wanted}
    finally:
        server.stop()


def _demos_job(items, config) -> background.Job:
    wanted = list(dict.fromkeys(item.originalname for item in items if item.originalname in DEMOS))
    return background.Job("cli-privacy:demos", functools.partial(_run_demos, config._tmp_path_factory, wanted))


def background_jobs(items, config) -> list[background.Job]:
    """The selected tests' demos start once the tests are collected, beside the tests (tests/background.py)."""
    return [_demos_job(items, config)] if any(item.originalname in DEMOS for item in items) else []


@pytest.fixture(scope="module")
def demos(request) -> dict:
    """Each selected test's demo run (started beside the earlier tests; run now if it was not)."""
    items = [item for item in request.session.items if item.module is request.module]
    return background.job("cli-privacy:demos", functools.partial(_demos_job, items, request.config)).result()


def test_private_demo_reports_the_ledgers_epsilon(demos):
    out = demos["test_private_demo_reports_the_ledgers_epsilon"]
    assert out.returncode == 0, out.stdout + out.stderr
    match = LAST_LINE.match(out.stdout.strip().splitlines()[-1])
    assert match, out.stdout
    epsilon, delta, rounds, stddev = float(match[1]), float(match[2]), int(match[3]), float(match[4])
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dpe.PoissonSampledDpEvent(0.05, dpe.GaussianDpEvent(1.1)), 4)
    assert epsilon == pytest.approx(accountant.get_epsilon(1e-6), rel=1e-5)
    assert (delta, rounds) == (1e-6, 4) and stddev == pytest.approx(1.1 * 0.5, rel=1e-5)


def test_private_demo_stops_when_the_budget_is_exhausted(demos):
    out = demos["test_private_demo_stops_when_the_budget_is_exhausted"]
    assert out.returncode != 0
    assert "budget exhausted" in out.stderr
    assert out.stdout.count("round ") == 2  # z = 1, no sampling: 4.73 then 7.08, a third would be 9.01


def test_private_demo_with_secure_noise_spends_opendps_zcdp_epsilon(demos):
    import opendp.prelude as opendp

    opendp.enable_features("contrib")
    out = demos["test_private_demo_with_secure_noise_spends_opendps_zcdp_epsilon"]
    assert out.returncode == 0, out.stdout + out.stderr
    assert "secure noise (zCDP, sampling not claimed)" in out.stdout
    epsilon, delta, rounds, stddev = (float(v) for v in LAST_LINE.match(out.stdout.strip().splitlines()[-1]).groups())
    space = opendp.vector_domain(opendp.atom_domain(T="i64")), opendp.l2_distance(T="i64")
    composed = opendp.c.make_composition([opendp.m.make_gaussian(*space, scale=1.5)] * 3)  # rho = 1 / (2 z^2) each
    assert epsilon == pytest.approx(opendp.c.make_zCDP_to_approxDP(composed).map(1).epsilon(1e-5), rel=1e-5)
    assert rounds == 3 and 1.5 * 0.5 < stddev < 1.5 * 0.5 * 1.002  # the grid widens the noise by under 0.2%


def test_private_demo_with_a_blt_stream_spends_one_gaussian_event(demos):
    """--mechanism blt: 3 rounds share one stream; the last epsilon is one Gaussian event of z (dp_accounting's
    RDP), the stddev z C times the stream's sensitivity (jax_privacy's, for its one-buffer optimum at n = 3, b = 1,
    k = 3)."""
    out = demos["test_private_demo_with_a_blt_stream_spends_one_gaussian_event"]
    assert out.returncode == 0, out.stdout + out.stderr
    assert "one blt noise stream for the 3 rounds (sampling not claimed)" in out.stdout
    epsilon, delta, rounds, stddev = (float(v) for v in LAST_LINE.match(out.stdout.strip().splitlines()[-1]).groups())
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dpe.GaussianDpEvent(1.0), 1)
    assert epsilon == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-5) and rounds == 3
    import jax
    import numpy as np
    from jax_privacy.matrix_factorization import buffered_toeplitz, toeplitz

    with jax.enable_x64():  # jax_privacy's optimum for n = 3, b = 1, k = 3 and its sensitivity
        blt = buffered_toeplitz.optimize(n=3, min_sep=1, max_participations=3, min_buffers=1, max_buffers=1)
        sens = float(np.sqrt(toeplitz.minsep_sensitivity_squared(blt.toeplitz_coefs(3), min_sep=1,
                                                                 max_participations=3)))
    assert stddev == pytest.approx(1.0 * 1.0 * sens, rel=1e-5)
