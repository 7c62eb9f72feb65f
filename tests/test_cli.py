"""The clipd command, run as a real subprocess.

The demos run beside the earlier tests (tests/background.py), one after the other, against one ``clipd serve``
process that the tests then ask about what the demos left.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import background
import pytest
import test_tls
from service_helpers import like_test_settings

from clipd.client import Client

pki = test_tls.pki  # a CA and a server certificate it signed, for test_status_over_https_...

DEMO_TESTS = ("test_demo_against_a_running_server", "test_demo_keep_leaves_its_finalized_aggregation_and_by_default_leaves_none")
UNREACHABLE = ("test_demo_fails_when_the_server_is_unreachable", "cli:unreachable")


def _demo(target: str, *flags: str) -> subprocess.CompletedProcess:
    return background.run_process([sys.executable, "-m", "clipd", "demo", "--target", target, *flags], 300)


def _run_demos(tmp_path_factory) -> dict:
    """A ``clipd serve`` (the settings of TEST_SETTINGS), left running for the tests, and the demos: 300 examples;
    50 examples, by default and with ``--keep``, with the server's aggregations listed before and between them."""
    server = like_test_settings(tmp_path_factory.mktemp("cli-demo"))
    server.start()
    background.at_session_end(server.stop)
    target = f"127.0.0.1:{server.port}"
    runs: dict = {"server": server, "target": target, "300": _demo(target, "--examples", "300")}
    with Client(target) as client:
        runs["before"] = {a.aggregation_id for a in client.list_aggregations()}
        runs["50"] = _demo(target, "--examples", "50")
        runs["after"] = {a.aggregation_id for a in client.list_aggregations()}
    runs["50 --keep"] = _demo(target, "--examples", "50", "--keep")
    return runs


def _unreachable_job() -> background.Job:
    return background.Job(UNREACHABLE[1], functools.partial(_demo, "127.0.0.1:1", "--examples", "10",
                                                            "--retry-timeout", "1"))


def _demos_job(config) -> background.Job:
    return background.Job("cli:demos", functools.partial(_run_demos, config._tmp_path_factory))


def background_jobs(items, config) -> list[background.Job]:
    """The demos start once the tests are collected, beside the tests (tests/background.py)."""
    names = {item.originalname for item in items}
    return ([_demos_job(config)] if names & set(DEMO_TESTS) else []) + (
        [_unreachable_job()] if UNREACHABLE[0] in names else [])


@pytest.fixture(scope="module")
def demos(request):
    """The demos' runs (started beside the earlier tests; run now if they were not), and their server."""
    runs = background.job("cli:demos", functools.partial(_demos_job, request.config)).result()
    yield runs
    runs["server"].stop()


def test_demo_against_a_running_server(demos):
    out = demos["300"]
    assert out.returncode == 0, out.stdout + out.stderr
    assert "aggregated 300 examples" in out.stdout
    assert "result matches the in-process computation" in out.stdout
    assert "dense/kernel" in out.stdout


def test_demo_keep_leaves_its_finalized_aggregation_and_by_default_leaves_none(demos):
    out = demos["50"]
    assert out.returncode == 0, out.stdout + out.stderr
    assert demos["after"] == demos["before"]  # cancelled: nothing left
    out = demos["50 --keep"]
    assert out.returncode == 0, out.stdout + out.stderr
    kept = re.search(r"kept aggregation (\S+) on the server", out.stdout).group(1)
    with Client(demos["target"]) as client:
        assert client.get_aggregation(kept).state == client.get_aggregation(kept).FINALIZED
        client.cancel(kept)


def test_demo_fails_when_the_server_is_unreachable():
    assert background.job(UNREACHABLE[1], _unreachable_job).result().returncode != 0


def test_serve_help_lists_the_ports():
    out = subprocess.run([sys.executable, "-m", "clipd", "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--host", "--grpc-port", "--admin-port"):
        assert flag in out.stdout


def test_serve_runs_until_sigterm_and_serves_both_ports():
    import json
    import re
    import signal
    import urllib.request

    import numpy as np

    from clipd.client import Client

    proc = subprocess.Popen(
        [sys.executable, "-m", "clipd", "serve", "--host", "127.0.0.1", "--grpc-port", "0", "--admin-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        found = re.search(r"gRPC on 127\.0\.0\.1:(\d+), admin API on http://127\.0\.0\.1:(\d+)", line)
        assert found, line + proc.stderr.read()
        grpc_port, admin_port = map(int, found.groups())
        with Client(f"127.0.0.1:{grpc_port}") as c:
            agg = c.create_aggregation({"x": (3,)}, l2_norm_clip=1.0)
            c.submit(agg, np.ones((4, 3), np.float32))
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/api/v1/aggregations/{agg}", timeout=30) as r:
            assert json.load(r)["examples"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_every_flag_of_every_subcommand_explains_itself_and_version_is_the_projects():
    """Each option of ``clipd``, ``clipd serve`` and ``clipd demo`` has help text; ``clipd --version`` prints
    pyproject.toml's version."""
    import argparse
    import pathlib
    import tomllib

    from clipd.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    checked = 0
    for name, sub in [("clipd", parser), *subparsers.choices.items()]:
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction) or not action.option_strings:
                continue
            said = re.sub(r"\(env CLIPD_\w+; default: [^)]*\)", "", action.help or "").strip()  # beyond those
            assert said, (name, action.option_strings)
            checked += 1
    assert checked > 60  # every setting of serve, and demo's
    version = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]
    out = subprocess.run([sys.executable, "-m", "clipd", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"clipd {version}"


# clipd status: a running server's aggregations and ledgers, read from its admin API -----------------------------
STATUS_PATHS = ("/readyz", "/api/v1/server", "/api/v1/aggregations", "/api/v1/ledgers", "/api/v1/streams")


def _admin_json(server, path: str) -> dict:
    import json
    import urllib.error
    import urllib.request

    from conftest import ADMIN_TOKEN

    request = urllib.request.Request(f"http://127.0.0.1:{server.admin.port}{path}",
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:  # /readyz answers 503 with its reasons
        return json.load(e)


def _section(out: str, title: str) -> list[list[str]]:
    """The rows (cells split at 2+ spaces) of the table under the line ``N <title>``, header first."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if re.fullmatch(rf"\d+ {title}s?", line))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


@pytest.fixture(scope="module")
def populated(auth_server):
    """On ``auth_server``: a plain open and a plain finalized aggregation, a private finalized one on an
    independent ledger with a budget and a private open one on a banded noise stream's ledger (a BLT's takes
    seconds to optimize)."""
    import uuid

    import numpy as np
    from conftest import ADMIN_TOKEN

    from clipd.client import Client, Privacy

    independent, banded = f"ledger-{uuid.uuid4().hex[:8]}", f"stream-{uuid.uuid4().hex[:8]}"
    with Client(f"127.0.0.1:{auth_server.port}", token=ADMIN_TOKEN) as c:
        open_one = c.create_aggregation({"w": (3,)}, l2_norm_clip=1.0)
        c.submit(open_one, np.ones((5, 3), np.float32))  # norm sqrt(3) > 1: all 5 clipped
        finalized = c.create_aggregation({"w": (3,)}, l2_norm_clip=1.0)
        c.submit(finalized, np.full((8, 3), 0.1, np.float32))
        c.finalize(finalized)
        private = c.create_aggregation({"w": (3,)}, l2_norm_clip=1.0,
                                       privacy=Privacy(independent, 1e-5, noise_multiplier=1.0, max_epsilon=20.0))
        c.submit(private, np.ones((4, 3), np.float32))
        c.finalize(private)
        private_open = c.create_aggregation({"w": (3,)}, l2_norm_clip=1.0, privacy=Privacy(
            banded, 1e-6, noise_multiplier=1.0, mechanism="banded", releases=3))
    return dict(open=open_one, finalized=finalized, private=private, private_open=private_open,
                ledgers=(independent, banded))


def _status(server, *flags, token=True):
    from conftest import ADMIN_TOKEN

    from clipd.cli import main

    return main(["status", "--admin", f"http://127.0.0.1:{server.admin.port}",
                 *(["--token", ADMIN_TOKEN] if token else []), *flags])


def test_status_lists_every_aggregation_and_ledger_as_the_admin_api_does(auth_server, populated, capsys,
                                                                        monkeypatch):
    monkeypatch.delenv("CLIPD_ADMIN_TOKEN", raising=False)
    assert _status(auth_server) == 0
    out = capsys.readouterr().out
    limit = _admin_json(auth_server, "/readyz")["streams"]["limit"]
    assert re.match(rf"server http://127\.0\.0\.1:{auth_server.admin.port}: ready(, up \w+)?, Submit streams 0/{limit},"
                    r" buffered 0 B of [\d.]+ \w+, devices .+ \(\d+ steps\)\n", out), out
    api = _admin_json(auth_server, "/api/v1/aggregations")["aggregations"]
    header, *rows = _section(out, "aggregation")
    assert header == ["ID", "STATE", "CREATED", "AGE", "EXAMPLES", "BATCHES", "CLIPPED", "LEDGER"]
    assert [r[0] for r in rows] == [a["aggregation_id"] for a in api] and len(rows) == 4
    for row, a in zip(rows, api):
        assert re.fullmatch(r"[0-9a-f]{32}", row[0]) and row[1] == a["state"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", row[2]) and re.fullmatch(r"(\d+[dhm])?\d+[smh]", row[3])
        if a.get("privacy"):  # raw statistics withheld: said so, never a made-up 0
            assert a["examples"] is None and row[4:7] == ["withheld"] * 3
            assert row[7] == a["privacy"]["ledger_id"]
        else:
            assert (int(row[4]), int(row[5]), row[7]) == (a["examples"], a["batches"], "-")
    by_id = {r[0]: r for r in rows}
    assert by_id[populated["open"]][1:2] + by_id[populated["open"]][4:7] == ["open", "5", "1", "100.0%"]
    assert by_id[populated["finalized"]][1:2] + by_id[populated["finalized"]][4:7] == ["finalized", "8", "1", "0.0%"]
    assert by_id[populated["private"]][1] == "finalized" and by_id[populated["private_open"]][1] == "open"

    ledgers = {ledger["ledger_id"]: ledger for ledger in _admin_json(auth_server, "/api/v1/ledgers")["ledgers"]}
    header, *rows = _section(out, "privacy ledger")
    assert header == ["ID", "MECHANISM", "UNIT", "CLIENT IDS", "EPSILON", "MAX EPSILON", "DELTA", "RELEASES",
                      "STREAM LEFT", "AUDIT"]
    assert sorted(r[0] for r in rows) == sorted(populated["ledgers"]) == sorted(ledgers)
    for ledger_id, mechanism, unit, client_ids, epsilon, max_epsilon, delta, releases, left, audit in rows:
        ledger = ledgers[ledger_id]
        assert audit == "-" and ledger["audit"] is None  # (tests/test_audit.py shows an audited one)
        assert mechanism == ledger["mechanism"] and int(releases) == len(ledger["entries"])
        assert (unit, client_ids) == (ledger["unit"], (ledger["client_ids"] or "-").replace("_", "-"))
        assert float(epsilon) == pytest.approx(ledger["epsilon"], rel=1e-5)
        assert float(max_epsilon) == float(ledger["max_epsilon"]) and float(delta) == ledger["delta"]
        assert left == (f"{ledger['stream']['left']} of 3" if ledger["stream"] else "-")
    independent, banded = (ledgers[i] for i in populated["ledgers"])
    assert independent["epsilon"] > 0 and len(independent["entries"]) == 1 and independent["max_epsilon"] == 20.0
    assert banded["mechanism"] == "banded" and banded["max_epsilon"] == "inf" and banded["stream"]["left"] == 3
    # The banded stream's participation is enforced per client: ids from credentials (a server with a token).
    assert (banded["unit"], banded["client_ids"], independent["client_ids"]) == ("example", "credential", "")

    assert _status(auth_server, "--state", "finalized") == 0  # and the filter
    filtered = _section(capsys.readouterr().out, "aggregation")[1:]
    assert sorted(r[0] for r in filtered) == sorted([populated["finalized"], populated["private"]])


def test_status_json_is_the_admin_apis(auth_server, populated, capsys):
    import json

    assert _status(auth_server, "--json") == 0
    printed = json.loads(capsys.readouterr().out)
    api = {path: _admin_json(auth_server, path) for path in STATUS_PATHS}

    def still(body):  # without the fields that move with the clock: a rate over the last 10 s, now, uptime
        if isinstance(body, dict):
            return {k: still(v) for k, v in body.items()
                    if k not in ("examples_per_second", "now_unix_seconds", "uptime_seconds")}
        return [still(v) for v in body] if isinstance(body, list) else body

    assert still(printed) == still(api)
    assert {a["aggregation_id"] for a in printed["/api/v1/aggregations"]["aggregations"]} >= set(
        v for k, v in populated.items() if k != "ledgers")


def test_status_needs_the_admin_token_of_a_server_with_one(auth_server, populated, capsys, monkeypatch):
    monkeypatch.delenv("CLIPD_ADMIN_TOKEN", raising=False)
    assert _status(auth_server, token=False) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert "needs the admin token" in out.err and "--token" in out.err and "CLIPD_ADMIN_TOKEN" in out.err
    assert _status(auth_server, "--token", "wrong") == 1  # the last --token wins
    out = capsys.readouterr()
    assert "refused the token" in out.err and "--token" in out.err and out.err.count("\n") == 1
    from conftest import ADMIN_TOKEN

    monkeypatch.setenv("CLIPD_ADMIN_TOKEN", ADMIN_TOKEN)
    assert _status(auth_server, "--json", token=False) == 0
    assert populated["open"] in capsys.readouterr().out


def test_status_as_a_subprocess_with_its_environment_and_the_ls_alias(auth_server, populated):
    from conftest import ADMIN_TOKEN

    env = {**os.environ, "CLIPD_ADMIN_URL": f"127.0.0.1:{auth_server.admin.port}", "CLIPD_ADMIN_TOKEN": ADMIN_TOKEN}
    out = subprocess.run([sys.executable, "-m", "clipd", "ls"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(f"server http://127.0.0.1:{auth_server.admin.port}: ready")
    listed = {row[0]: row[1] for row in _section(out.stdout, "aggregation")[1:]}
    assert listed[populated["open"]] == "open" and listed[populated["finalized"]] == "finalized"


def test_status_of_an_unreachable_server_says_so_in_one_line():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "clipd", "status", "--admin", f"http://127.0.0.1:{port}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"can't reach the admin API at http://127.0.0.1:{port}" in out.stderr and "--admin" in out.stderr


def test_status_over_https_with_a_private_ca_and_an_empty_registry(pki, capsys):
    from conftest import TEST_SETTINGS

    from clipd.cli import main
    from clipd.server.app import create_server
    from clipd.server.settings import Settings

    server, _ = create_server(Settings(**{**TEST_SETTINGS, "admin_port": 0, "tls_cert_file": str(pki["server"].cert),
                                          "tls_key_file": str(pki["server"].key)}))
    try:
        url = f"https://127.0.0.1:{server.admin.port}"
        assert main(["status", "--admin", url]) == 1  # the system's CAs don't know ours
        err = capsys.readouterr().err
        assert "can't verify the certificate" in err and "--cafile" in err and err.count("\n") == 1
        assert main(["status", "--admin", url, "--cafile", str(pki["ca"].cert)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"server {url}: ready")
        assert "no aggregations: make one with `clipd demo --keep" in out and "no privacy ledgers" in out
    finally:
        server.stop(grace=1.0)


def test_the_doctests_of_the_status_module():
    import doctest

    from clipd import status

    result = doctest.testmod(status)
    assert result.attempted > 0 and result.failed == 0


def test_status_shows_shard_processes_restarts_and_failures_from_the_apis_fields():
    """What a one-process test server has none of: not ready, shard processes (one down, restarted), a failed
    aggregation's reason; fields the API may lack are left out, not invented."""
    from clipd.status import status_lines

    reads = {
        "/readyz": {"ready": False, "reasons": ["all 128 Submit stream slots are taken"]},
        "/api/v1/server": {"streams": {"active": 128, "limit": 128, "refused": 2}, "devices": [{"kind": "gpu"}] * 2,
                           "shard_processes": [{"index": 0, "alive": True, "serving": True, "restarts": 0,
                                                "streams": {"active": 64, "limit": 64}},
                                               {"index": 1, "alive": False, "serving": False, "restarts": 2}]},
        "/api/v1/aggregations": {"aggregations": [{"aggregation_id": "a" * 32, "state": "failed",
                                                   "created_unix_seconds": 1e9, "examples": 0, "batches": 0,
                                                   "clipped": 0, "failure_reason": "the store failed"}],
                                 "now_unix_seconds": 1e9 + 192},
        "/api/v1/ledgers": {"ledgers": []},
    }
    lines = status_lines("http://h:8080", reads, None)
    assert lines[0] == ("server http://h:8080: NOT READY (all 128 Submit stream slots are taken), Submit streams"
                        " 128/128 (2 refused), buffered ? of ?, devices 2 x gpu (0 steps)")
    assert lines[1] == "shard processes: 2, 2 restarts: #0 serving, streams 64/64; #1 DOWN, restarted 2x"
    row = re.split(r"\s{2,}", lines[5])
    assert row[:2] == ["a" * 32, "failed"] and row[3:] == ["3m12s", "0", "0", "-", "-"]
    assert lines[6] == f"{'a' * 32} failed: the store failed" and lines[-1] == "no privacy ledgers"
