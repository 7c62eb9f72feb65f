"""The clipd command, run as a real subprocess."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_against_a_running_server(server):
    out = subprocess.run(
        [sys.executable, "-m", "clipd", "demo", "--target", f"127.0.0.1:{server.port}", "--examples", "300"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "aggregated 300 examples" in out.stdout
    assert "result matches the in-process computation" in out.stdout
    assert "dense/kernel" in out.stdout


def test_demo_keep_leaves_its_finalized_aggregation_and_by_default_leaves_none(server, client):
    def demo(*flags):
        return subprocess.run([sys.executable, "-m", "clipd", "demo", "--target", f"127.0.0.1:{server.port}",
                               "--examples", "50", *flags], capture_output=True, text=True, timeout=300)

    before = {a.aggregation_id for a in client.list_aggregations()}
    out = demo()
    assert out.returncode == 0, out.stdout + out.stderr
    assert {a.aggregation_id for a in client.list_aggregations()} == before  # cancelled: nothing left
    out = demo("--keep")
    assert out.returncode == 0, out.stdout + out.stderr
    kept = re.search(r"kept aggregation (\S+) on the server", out.stdout).group(1)
    assert client.get_aggregation(kept).state == client.get_aggregation(kept).FINALIZED
    client.cancel(kept)


def test_demo_fails_when_the_server_is_unreachable():
    out = subprocess.run(
        [sys.executable, "-m", "clipd", "demo", "--target", "127.0.0.1:1", "--examples", "10",
         "--retry-timeout", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode != 0


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
