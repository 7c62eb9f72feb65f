"""What the two DP-SGD examples share: the data, the command line, the server, the admin API, the report.

The training loops themselves are in ``dpsgd_torch.py`` and ``dpsgd_jax.py``;
this module has nothing of a framework in it (numpy, scikit-learn for the
data, matplotlib for the plot, the clipd client).

The data: scikit-learn's digits (1,797 8x8 grey images of 0-9, shipped inside
the package: nothing is downloaded), pixels scaled to [0, 1], split once with
a fixed seed into 1,438 training and 359 test images.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import pathlib
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence

import numpy as np

from clipd.client.dpsgd import poisson_sample

TEST_FRACTION = 0.2
SPLIT_SEED = 0


@dataclasses.dataclass(frozen=True)
class Digits:
    x_train: np.ndarray  # (1438, 64) float32 in [0, 1]
    y_train: np.ndarray  # (1438,) int64
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits() -> Digits:
    """scikit-learn's digits, scaled to [0, 1] and split 80/20 (the same split every run)."""
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    test = round(len(y) * TEST_FRACTION)
    return Digits(x[order[test:]], y[order[test:]], x[order[:test]], y[order[:test]])


def parser(description: str) -> argparse.ArgumentParser:
    """The examples' command line (the defaults: about 93% test accuracy at epsilon 2.9, delta 1e-5)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--target", default=None,
                   help="HOST:PORT of a clipd server (default: start one in this process, durable store in a"
                        " temporary directory)")
    p.add_argument("--admin", default=None,
                   help="URL of that server's admin API, for the clip fractions (with --target)")
    p.add_argument("--token", default=None, help="the server's admin token, if it has one")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (for quick runs)")
    p.add_argument("--batch-size", type=float, default=256.0,
                   help="the expected batch size q * n: each example joins a step with probability q")
    p.add_argument("--clip", type=float, default=1.0, help="C, the bound on one example's gradient")
    p.add_argument("--noise-multiplier", type=float, default=2.0, help="z: noise stddev z * C")
    p.add_argument("--clipping", choices=["flat", "per_layer"], default="flat",
                   help="flat: the whole gradient to C; per_layer: each of K layers to C / sqrt(K)")
    p.add_argument("--metrics-noise-multiplier", type=float, default=10.0,
                   help="z_m of the released clip counts (0: none; the sum's noise rises so that z holds)")
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--max-epsilon", type=float, default=0.0, help="stop when a step would pass it (0: no budget)")
    p.add_argument("--seed", type=int, default=0,
                   help="the model's initial weights; the Poisson sampling and the noise stay secret")
    p.add_argument("--seed-sampling", action="store_true",
                   help="draw the Poisson samples from --seed too (reproducible runs; the noise stays secret)")
    p.add_argument("--mechanism", choices=["independent", "blt", "banded"], default="independent",
                   help="independent: fresh noise each step, Poisson sampling; blt or banded: DP-FTRL, the"
                        " steps' noise one correlated stream planned for the run's epochs, each example in one"
                        " batch of every epoch (shuffled), no sampling amplification, no released clip counts")
    p.add_argument("--buffers", type=int, default=0,
                   help="blt: the stream's buffers; banded: its bands (0: chosen by the optimizer)")
    p.add_argument("--out", default="dpsgd-out", help="folder for the plot and the history (JSON)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def clipd_policy(clipping: str) -> str:
    return {"flat": "global", "per_layer": "per_layer_uniform"}[clipping]


@contextlib.contextmanager
def clipd_server(args) -> Iterator[tuple[str, str | None]]:
    """``(target, admin_url)``: the server of ``--target``, or one started here on loopback ports."""
    if args.target is not None:
        yield args.target, args.admin
        return
    from clipd.server.app import create_server
    from clipd.server.settings import Settings

    logging.getLogger("absl").setLevel(logging.ERROR)  # dp_accounting's numerical notes
    with tempfile.TemporaryDirectory(prefix="clipd-dpsgd-") as data_dir:
        server, port = create_server(Settings(host="127.0.0.1", grpc_port=0, admin_port=0, data_dir=data_dir, max_device_rows=256,
                                              log_level="warning"))
        try:
            print(f"started an embedded clipd server on 127.0.0.1:{port} (durable store in {data_dir})",
                  file=sys.stderr)
            yield f"127.0.0.1:{port}", f"http://127.0.0.1:{server.admin.port}"
        finally:
            server.stop(grace=1.0)


def admin_clip_fractions(admin_url: str | None, aggregations: Sequence[str], token: str | None = None
                         ) -> dict[str, float]:
    """Per layer: the fraction of the epoch's examples whose layer was clipped, from the admin API.

    Each step's release carries noised per-layer clip counts and a noised example count (only those:
    the raw counters are withheld under a privacy policy); summing over the epoch's steps before
    dividing keeps the noise small. Empty without an admin API or released statistics.
    """
    if admin_url is None or not aggregations:
        return {}
    clipped, examples, layers = 0.0, 0.0, []
    for aggregation in aggregations:
        request = urllib.request.Request(f"{admin_url}/api/v1/aggregations/{aggregation}")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=10) as response:
            view = json.load(response)
        release = view["privacy"]["release"]
        if not release or not release["layer_clipped"]:
            return {}
        layers = [layer["name"] for layer in view["layers"]]  # the order of the release's counts
        clipped = clipped + np.asarray(release["layer_clipped"], np.float64)
        examples += release["examples"]
    return {name: float(np.clip(c / max(examples, 1.0), 0.0, 1.0)) for name, c in zip(layers, clipped)}


class Progress:
    """A one-line progress bar on stderr: ``epoch 3/15 [#####.....] 6/11 steps  eps 1.42``."""

    def __init__(self, epoch: int, epochs: int, steps: int, quiet: bool = False) -> None:
        self.epoch, self.epochs, self.steps, self.quiet = epoch, epochs, steps, quiet
        self.started = time.perf_counter()

    def update(self, done: int, epsilon: float) -> None:
        if self.quiet:
            return
        width = 30
        filled = int(width * done / max(self.steps, 1))
        rate = done / max(time.perf_counter() - self.started, 1e-9)
        print(f"\repoch {self.epoch}/{self.epochs} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.steps}"
              f" steps  {rate:5.1f} steps/s  eps {epsilon:.3f}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.quiet:
            print(file=sys.stderr, flush=True)


@dataclasses.dataclass
class Epoch:
    epoch: int
    steps: int
    epsilon: float
    accuracy: float
    clip_fraction: dict[str, float]
    seconds: float


def open_dpsgd(args, client, layers: dict[str, tuple[int, ...]], dataset_size: int, admin: str | None):
    """The run's :class:`~clipd.client.dpsgd.DpSgd` from the flags (its steps kept for the admin API)."""
    from clipd.client.dpsgd import DpSgd

    correlated = args.mechanism != "independent"
    per_epoch = steps_per_epoch(args, dataset_size)
    return DpSgd(client, layers, l2_norm_clip=args.clip, noise_multiplier=args.noise_multiplier,
                 policy=clipd_policy(args.clipping), sampling_rate=args.batch_size / dataset_size,
                 dataset_size=dataset_size, delta=args.delta, max_epsilon=args.max_epsilon,
                 metrics_noise_multiplier=0.0 if correlated else args.metrics_noise_multiplier,
                 keep=admin is not None, mechanism=args.mechanism, steps=per_epoch * args.epochs if correlated else 0,
                 epochs=args.epochs, buffers=args.buffers)


def batch(args, dataset_size: int, dp, rng: np.random.Generator, epoch_order: np.ndarray, done: int) -> np.ndarray:
    """Step ``done`` (1-based) of an epoch: a Poisson sample (independent noise), or the ``done``-th of the
    epoch's disjoint batches in ``epoch_order`` (a correlated stream: each example once an epoch)."""
    if args.mechanism == "independent":
        return poisson_sample(dataset_size, dp.sampling_rate, rng)
    per_epoch = steps_per_epoch(args, dataset_size)
    return np.sort(np.array_split(epoch_order, per_epoch)[done - 1])


def end_epoch(args, dp, admin: str | None, epoch: int, accuracy: float, started: float) -> Epoch:
    """The epoch's record (clip fractions from the admin API, then its steps' aggregations dropped), printed."""
    fractions = admin_clip_fractions(admin, dp.kept, args.token)
    dp.cancel_kept()
    record = Epoch(epoch, dp.steps, dp.epsilon, accuracy, fractions, time.perf_counter() - started)
    report_epoch(record, args.delta)
    return record


def steps_per_epoch(args, dataset_size: int) -> int:
    """One epoch is 1/q steps (each example is sampled once per epoch on average)."""
    return max(1, round(dataset_size / args.batch_size))


def stop(args, dp) -> bool:
    """Whether --steps is reached."""
    return args.steps is not None and dp.steps >= args.steps


def sampling_rng(args) -> np.random.Generator:
    """The Poisson sampling's randomness: the OS's (what the epsilon assumes) unless --seed-sampling."""
    return np.random.default_rng(args.seed + 1 if args.seed_sampling else None)


def report_epoch(record: Epoch, delta: float) -> None:
    fractions = " ".join(f"{name} {f:.2f}" for name, f in record.clip_fraction.items())
    print(f"epoch {record.epoch}: test accuracy {record.accuracy:.4f}  epsilon {record.epsilon:.4f}"
          f" (delta {delta:g})  steps {record.steps}" + (f"  clipped: {fractions}" if fractions else ""),
          flush=True)


def opacus_epsilon(noise_multiplier: float, sampling_rate: float, steps: int, delta: float) -> float | None:
    """Opacus' RDP accountant's epsilon for the same run (None without opacus installed)."""
    try:
        from opacus.accountants import RDPAccountant
    except ImportError:
        return None
    accountant = RDPAccountant()
    accountant.history = [(noise_multiplier, sampling_rate, steps)]
    return float(accountant.get_epsilon(delta))


def finish(args, framework: str, history: list[Epoch], dp, seconds_per_phase: dict[str, list[float]]) -> dict:
    """The closing lines, the history as JSON and the plot; returns the summary."""
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = dp.steps
    summary = {
        "framework": framework, "steps": steps, "epochs": len(history),
        "accuracy": history[-1].accuracy if history else math.nan,
        "epsilon": dp.epsilon, "delta": args.delta, "noise_multiplier": args.noise_multiplier,
        "sampling_rate": dp.sampling_rate, "clip": args.clip, "clipping": args.clipping,
        "mechanism": args.mechanism,
        "opacus_rdp_epsilon": (opacus_epsilon(args.noise_multiplier, dp.sampling_rate, steps, args.delta)
                               if args.mechanism == "independent" else None),
        "median_ms_per_phase": {k: 1e3 * float(np.median(v)) for k, v in seconds_per_phase.items() if v},
        "history": [dataclasses.asdict(h) for h in history],
    }
    (out / f"dpsgd_{framework}.json").write_text(json.dumps(summary, indent=1))
    opacus = summary["opacus_rdp_epsilon"]
    print(f"accuracy={summary['accuracy']:.4f} epsilon={dp.epsilon:.6g} delta={args.delta:g} steps={steps}"
          f" noise_multiplier={args.noise_multiplier:g} sampling_rate={dp.sampling_rate:.6g}"
          + (f" opacus_rdp_epsilon={opacus:.6g}" if opacus is not None else ""), flush=True)
    if opacus is None and args.mechanism == "independent":
        print("(opacus_rdp_epsilon, Opacus' accountant on the same run, is printed when opacus is installed:"
              " pip install opacus==1.6.0)", file=sys.stderr)
    if not args.no_plot and history:
        path = write_plot(out / f"dpsgd_{framework}.png", history, framework, args)
        print(f"plot: {path}", file=sys.stderr)
    return summary


def write_plot(path: pathlib.Path, history: list[Epoch], framework: str, args) -> pathlib.Path:
    """Test accuracy against epsilon, and the clip fraction of each layer per epoch (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot([h.epsilon for h in history], [h.accuracy for h in history], marker="o")
    left.set_xlabel(f"epsilon (delta = {args.delta:g})")
    left.set_ylabel("test accuracy")
    left.set_ylim(0, 1)
    left.grid(alpha=0.3)
    left.set_title(f"DP-SGD through clipd ({framework}), z = {args.noise_multiplier:g}, C = {args.clip:g}")
    layers = list(history[-1].clip_fraction)
    if args.clipping == "flat" and layers:  # one bound for the whole example: every layer's fraction is the
        # same quantity plus its own noise, so one line, their mean (less noisy than any one of them)
        right.plot([h.epoch for h in history],
                   [float(np.mean([h.clip_fraction.get(n, math.nan) for n in layers])) for h in history],
                   marker=".", label=f"whole examples (mean of {len(layers)} layers' noised counts)")
    else:
        for name in layers:
            right.plot([h.epoch for h in history], [h.clip_fraction.get(name, math.nan) for h in history],
                       marker=".", label=name)
    right.set_xlabel("epoch")
    right.set_ylabel("fraction of examples clipped (noised, admin API)")
    right.set_ylim(0, 1.05)
    right.grid(alpha=0.3)
    right.set_title(f"{args.clipping} clipping")
    if layers:
        right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
