"""NVIDIA FLARE's FedAvg with clipd as its aggregator: site-level central DP on the digits, in NVFlare's simulator.

    pip install 'torch==2.13.0' '.[server,nvflare,examples]'    # the CPU build of torch on these machines
    python examples/nvflare/job.py --rounds 10                   # starts an embedded clipd server

The training split of scikit-learn's digits is dealt over ``--sites`` simulated sites. Each round every site
trains the global model on its shard and sends its update; clipd clips each site's update to ``--clip`` (one
L2 norm over the model), sums, adds Gaussian noise of stddev ``z * C`` and accounts the release on a ledger
(each site one unit of privacy); the new global model is ``global + noised_sum / m``. It prints each round's
test accuracy (of the model the round starts from, measured by site 1 on the public test split) and the
ledger's epsilon, then the final model's, and ends with the line
``nvflare: rounds=<r> accuracy=<a> epsilon=<e>``.

The defaults (3 sites, z = 0.1) train (about 90% after 4 rounds) at an epsilon that protects nothing (272 after
4 rounds at delta 1e-3): with 3 sites the noise on the mean, z * C / 3 per coordinate, leaves no room for a
useful epsilon. docs/nvflare.md gives the accuracy against z and the number of sites.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # digits_net, beside this file (NVFlare copies it to the server and the sites)

import torch  # noqa: E402
from digits_net import DigitsNet, accuracy, digits  # noqa: E402

from clipd.client import Client, Privacy  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--threads", type=int, default=None,
                   help="processes that run the sites in NVFlare's simulator (default: one per site)")
    p.add_argument("--noise-multiplier", type=float, default=0.1,
                   help="z: the noise of the sum is z * C (0: clipped, not noised: no privacy, epsilon inf)")
    p.add_argument("--clip", type=float, default=1.0, help="C, the bound on one site's update")
    p.add_argument("--delta", type=float, default=1e-3)
    p.add_argument("--max-epsilon", type=float, default=0.0, help="stop at this budget (0: none)")
    p.add_argument("--local-epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--target", default=None,
                   help="HOST:PORT of a clipd server (default: start one in this process, memory store)")
    p.add_argument("--token", default=None, help="the server's admin or submitter token, if it has one")
    p.add_argument("--workspace", default=None, help="NVFlare's simulation workspace (default: a temporary one)")
    p.add_argument("--ledger", default=None, help="the privacy ledger's id (default: a new one)")
    p.add_argument("--sites-submit", action="store_true",
                   help="each site submits its update to clipd itself; NVFlare's server gets receipts")
    return p.parse_args(argv)


@contextlib.contextmanager
def clipd_target(args: argparse.Namespace):
    """The server of ``--target``, or one started here on a loopback port."""
    if args.target is not None:
        yield args.target
        return
    from clipd.server.app import create_server
    from clipd.server.settings import Settings

    logging.getLogger("absl").setLevel(logging.ERROR)
    server, port = create_server(Settings(host="127.0.0.1", grpc_port=0, admin_port=-1, data_dir="memory",
                                          log_level="warning"))
    try:
        print(f"started an embedded clipd server on 127.0.0.1:{port}", file=sys.stderr)
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=1.0)


def run(args: argparse.Namespace, target: str, workspace: pathlib.Path) -> dict:
    from nvflare.recipe import SimEnv

    from clipd.client.nvflare import ClipdFedAvgRecipe

    ledger = args.ledger or f"nvflare-digits-{int(time.time() * 1000)}"
    privacy = Privacy(ledger_id=ledger, delta=args.delta, noise_multiplier=args.noise_multiplier,
                      max_epsilon=args.max_epsilon) if args.noise_multiplier > 0 else None
    report = workspace / "accuracy.jsonl"
    if args.token:
        os.environ["CLIPD_TOKEN"] = args.token  # (the aggregator reads it on NVFlare's server)
    recipe = ClipdFedAvgRecipe(
        name="clipd_digits", min_clients=args.sites, num_rounds=args.rounds, model=DigitsNet(),
        train_script=str(HERE / "client.py"),
        train_args=f"--sites {args.sites} --local-epochs {args.local_epochs} --lr {args.lr} --report {report}",
        clipd_target=target, clipping_norm=args.clip, privacy=privacy, sites_submit=args.sites_submit,
    )
    recipe.execute(SimEnv(num_clients=args.sites, num_threads=args.threads, workspace_root=str(workspace)))
    if privacy is not None:
        with Client(target, token=args.token) as client:
            book = client.ledger(ledger)
        epsilons, epsilon = [entry.epsilon_after for entry in book.entries], book.epsilon
    else:  # no noise: every round released, no privacy
        epsilons, epsilon = [float("inf")] * args.rounds, float("inf")
    seen = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    final = _final_model(workspace)
    _, _, x_test, y_test = digits()
    final_accuracy = accuracy(final, x_test, y_test)
    print(f"{'round':>5} | {'accuracy':>8} | {'epsilon':>8}")
    for k, epsilon in enumerate(epsilons):  # round k's release; the accuracy of the model it made
        after = next((r["accuracy"] for r in seen if r["round"] == k + 1), final_accuracy)
        print(f"{k:>5} | {after:8.3f} | {epsilon:8.3f}")
    return {"rounds": len(epsilons), "accuracy": final_accuracy, "epsilon": epsilon,
            "epsilons": epsilons, "ledger": ledger}


def _final_model(workspace: pathlib.Path) -> DigitsNet:
    """The last saved global model (NVFlare's persistor writes it in the server's app folder)."""
    saved = sorted(workspace.rglob("FL_global_model.pt"), key=lambda p: p.stat().st_mtime)
    if not saved:
        raise SystemExit(f"no global model was saved under {workspace}: see the server's log there")
    state = torch.load(saved[-1], map_location="cpu", weights_only=False)
    model = DigitsNet()
    model.load_state_dict(state.get("model", state) if isinstance(state, dict) else state)
    return model


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    with clipd_target(args) as target, contextlib.ExitStack() as stack:
        workspace = pathlib.Path(args.workspace) if args.workspace else pathlib.Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="clipd-nvflare-")))
        result = run(args, target, workspace)
    print(f"nvflare: rounds={result['rounds']} accuracy={result['accuracy']:.4f} epsilon={result['epsilon']:.4f}")
    return result


if __name__ == "__main__":
    main()
