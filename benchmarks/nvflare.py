"""Large models through NVIDIA FLARE's FedAvg: NVFlare's own aggregation against clipd as its aggregator.

What runs (loopback; NVFlare 2.9's simulator, one process per site): a model of P float32 parameters (one
layer, default P = 2^27: 512 MiB), R rounds (default 2), each site adding a small constant to the global model
and sending the difference (``params_transfer_type=DIFF``: P x 4 bytes per site and round). Rows:

  nvflare fedavg            NVFlare's FedAvg with its built-in aggregation (numpy exchange format)
  nvflare fedavg+offload    the same with ``enable_tensor_disk_offload`` (PyTorch exchange format: each site's
                            tensors are written to disk as they stream in, read back to aggregate)
  clipd                     ``ClipdFedAvgRecipe``: each site's update streamed into a ``clipd serve`` (a subprocess,
                            memory store, ``--max-parameters P``) as it arrives; clip C = 1e9 (no clipping), z = 0
  clipd sites-submit        the same with ``sites_submit=True``: each site streams its update into clipd itself
                            and NVFlare's server gets a receipt

Each row is run for each ``--sites`` count. Memory: every 50 ms the VmRSS of the job's process tree is summed,
split into NVFlare's server (the simulator's process and its children that are not site workers) and the sites;
``clipd serve``'s tree is sampled the same way. The round time is that of the last round in the server's log
("Round R-1 started." to "Finished FedAvg."), so the simulator's start-up and the first round's warm-up are
outside it. Ratios: clipd's NVFlare-server peak over NVFlare's own FedAvg's (same sites), clipd's NVFlare-server
peak at the most sites over the fewest, and the round time over NVFlare's own FedAvg's.

    pip install 'torch==2.13.0' '.[server,nvflare]'
    python benchmarks/nvflare.py                      # P = 2^27, 3 and 6 sites
    python benchmarks/nvflare.py --params 1048576 --sites 3   # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

from large import RssSampler, Server, process_tree, tree_rss  # benchmarks/large.py (this script's directory)

MODEL = """
import torch
from torch import nn

PARAMS = {params}


class Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(PARAMS))
"""

SITE = """
import nvflare.client as flare
import torch

flare.init()
site = int(flare.get_site_name().rsplit("-", 1)[1])
while flare.is_running():
    received = flare.receive()
    params = {k: torch.as_tensor(v) + 1e-3 * site for k, v in received.params.items()}
    flare.send(flare.FLModel(params=params, params_type=flare.ParamsType.FULL))
"""

JOB = """
import sys
sys.path.insert(0, {here!r})
from nvflare.client.config import ExchangeFormat, TransferType
from nvflare.recipe import SimEnv
from big_model import Big
kind, sites, rounds, target = {kind!r}, {sites}, {rounds}, {target!r}
common = dict(name="big", min_clients=sites, num_rounds=rounds, model=Big(), train_script={site!r},
              params_transfer_type=TransferType.DIFF)
if kind.startswith("clipd"):
    from clipd.client.nvflare import ClipdFedAvgRecipe
    recipe = ClipdFedAvgRecipe(clipd_target=target, clipping_norm=1e9, sites_submit=kind == "clipd sites-submit",
                               **common)
else:
    from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe
    offload = kind == "nvflare fedavg+offload"
    recipe = FedAvgRecipe(enable_tensor_disk_offload=offload,
                          server_expected_format=ExchangeFormat.PYTORCH if offload else ExchangeFormat.NUMPY, **common)
recipe.execute(SimEnv(num_clients=sites, workspace_root={workspace!r}))
"""


def _is_site(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"simulator_worker" in f.read()
    except OSError:
        return False


class Peaks:
    """Samples the peak RSS of a job's NVFlare server (its tree but the site workers) and sites every 50 ms."""

    def __init__(self, job: int) -> None:
        self.job = job
        self.server = self.sites = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            sites = sum(tree_rss(p) for p in process_tree(self.job) if _is_site(p))  # (a site's children too)
            self.server = max(self.server, tree_rss(self.job) - sites)
            self.sites = max(self.sites, sites)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _round_seconds(workspace: pathlib.Path, rounds: int) -> float:
    """The last round's time in NVFlare's server log."""
    log = "\n".join(p.read_text(errors="replace") for p in workspace.rglob("log.txt") if "server" in p.parts)
    stamp, marks = None, {}
    for line in log.splitlines():  # (a banner's text sits on a line of its own, after its stamped line)
        if found := re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", line):
            stamp = time.mktime(time.strptime(found[1], "%Y-%m-%d %H:%M:%S")) + int(found[2]) / 1000
        for mark in (f"Round {rounds - 1} started", "Finished FedAvg"):
            if mark in line and stamp is not None:
                marks[mark] = stamp
    if len(marks) < 2:
        raise RuntimeError(f"no round {rounds - 1} in the server's log under {workspace}:\n{log[-3000:]}")
    return marks["Finished FedAvg"] - marks[f"Round {rounds - 1} started"]


def run_row(kind: str, sites: int, params: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="clipd-nvflare-bench-") as tmp:
        here = pathlib.Path(tmp)
        (here / "big_model.py").write_text(MODEL.format(params=params))
        (here / "site.py").write_text(SITE)
        clipd = Server("memory", params, tmp, [], start_timeout=120.0) if kind.startswith("clipd") else None
        idle = tree_rss(clipd.proc.pid) if clipd is not None else 0  # (started, nothing open)
        workspace = here / "workspace"
        code = textwrap.dedent(JOB.format(here=str(here), kind=kind, sites=sites, rounds=rounds,
                                          target=clipd.target if clipd is not None else "",
                                          site=str(here / "site.py"), workspace=str(workspace)))
        started = time.monotonic()
        with contextlib.ExitStack() as stack:
            clipd_peak = stack.enter_context(RssSampler(clipd.proc.pid, 0.05)) if clipd is not None else None
            job = subprocess.Popen([sys.executable, "-c", code], cwd=here, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
            peaks = Peaks(job.pid)
            _, err = job.communicate(timeout=3600)
            peaks.stop()
        wall = time.monotonic() - started
        if clipd is not None:
            clipd.stop()
        if job.returncode != 0:
            raise RuntimeError(f"{kind} with {sites} sites failed:\n{err[-3000:]}")
        return {"kind": kind, "sites": sites, "round_s": _round_seconds(workspace, rounds), "wall_s": wall,
                "server_gb": peaks.server / 1e9, "sites_gb": peaks.sites / 1e9,
                "clipd_gb": clipd_peak.peak / 1e9 if clipd_peak is not None else None, "clipd_idle_gb": idle / 1e9}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=1 << 27)
    p.add_argument("--sites", type=int, nargs="+", default=[3, 6])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kinds", nargs="+", default=["nvflare fedavg", "nvflare fedavg+offload", "clipd",
                                                   "clipd sites-submit"])
    args = p.parse_args(argv)
    model_gb = args.params * 4 / 1e9
    print(f"nvflare benchmark: a model of {args.params:,} float32 parameters ({model_gb:.3f} GB), {args.rounds}"
          f" rounds, sites {args.sites}; NVFlare's simulator on this machine")
    rows = []
    for sites in args.sites:
        for kind in args.kinds:
            try:
                row = run_row(kind, sites, args.params, args.rounds)
            except RuntimeError as e:  # (e.g. the machine's memory: the kernel's OOM killer ends a process)
                print(f"  {kind} x {sites}: FAILED: {str(e).splitlines()[-1]}", flush=True)
                continue
            rows.append(row)
            print(f"  {kind} x {sites}: round {row['round_s']:.2f} s, server {row['server_gb']:.2f} GB, sites"
                  f" {row['sites_gb']:.2f} GB" + (f", clipd serve {row['clipd_gb']:.2f} GB (idle"
                                                   f" {row['clipd_idle_gb']:.2f})" if row["clipd_gb"] else ""),
                  flush=True)
    print()
    print(f"{'row':<24} | {'sites':>5} | {'round s':>8} | {'NVFlare server peak GB':>22} | {'/ model':>7} |"
          f" {'sites peak GB':>13} | {'clipd serve peak GB':>19} | {'(peak - idle) / model':>21}")
    print("-" * 128)
    for r in rows:
        clipd = (f"{r['clipd_gb']:19.2f} | {(r['clipd_gb'] - r['clipd_idle_gb']) / model_gb:21.2f}"
                 if r["clipd_gb"] is not None else f"{'':>19} | {'':>21}")
        print(f"{r['kind']:<24} | {r['sites']:>5} | {r['round_s']:8.2f} | {r['server_gb']:22.2f} |"
              f" {r['server_gb'] / model_gb:7.2f} | {r['sites_gb']:13.2f} | {clipd}")
    print()
    by = {(r["kind"], r["sites"]): r for r in rows}
    for sites in args.sites:
        clipd, fedavg = by.get(("clipd", sites)), by.get(("nvflare fedavg", sites))
        offload = by.get(("nvflare fedavg+offload", sites))
        if clipd and fedavg:
            print(f"sites={sites}: server_peak_ratio_clipd_vs_fedavg={clipd['server_gb'] / fedavg['server_gb']:.3f}"
                  f" round_time_ratio_clipd_vs_fedavg={clipd['round_s'] / fedavg['round_s']:.3f}")
        if clipd and offload:
            print(f"sites={sites}: server_peak_ratio_clipd_vs_offload={clipd['server_gb'] / offload['server_gb']:.3f}"
                  f" round_time_ratio_clipd_vs_offload={clipd['round_s'] / offload['round_s']:.3f}")
        direct = by.get(("clipd sites-submit", sites))
        if direct and fedavg:
            print(f"sites={sites}: server_peak_ratio_sites_submit_vs_fedavg="
                  f"{direct['server_gb'] / fedavg['server_gb']:.3f}"
                  f" round_time_ratio_sites_submit_vs_fedavg={direct['round_s'] / fedavg['round_s']:.3f}")
    clipd_rows = [r for r in rows if r["kind"] == "clipd"]
    if len(clipd_rows) > 1:
        first, last = clipd_rows[0], clipd_rows[-1]
        print(f"clipd_server_peak_ratio_{last['sites']}v{first['sites']}={last['server_gb'] / first['server_gb']:.3f}"
              f" clipd_serve_peak_over_idle_per_model="
              f"{statistics.median(r['clipd_gb'] - r['clipd_idle_gb'] for r in clipd_rows) / model_gb:.2f}")
    return rows


if __name__ == "__main__":
    main()
