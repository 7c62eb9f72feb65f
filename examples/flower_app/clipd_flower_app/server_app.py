"""The ServerApp: FedAvg's sampling and evaluation, training aggregated by a clipd server (ClipdStrategy).

Run config (pyproject.toml, or ``flwr run ... --run-config "key=value ..."``):

  clipd-target       HOST:PORT of the clipd server (``clipd serve``); its admin token, if it has one,
                     from the environment variable CLIPD_ADMIN_TOKEN
  num-server-rounds  rounds of training
  clients-per-round  m: clients sampled per round, and the public denominator of the mean
  clipping-norm      C, the bound on each client's update (ignored with adaptive-clipping = true)
  noise-multiplier   z (0: no noise; the ledger's epsilon is then infinite)
  delta, max-epsilon the ledger's delta and budget (max-epsilon 0: none)
  adaptive-clipping  move C with Andrew et al.'s quantile rule (on the server's ledger), from clipping-norm
  count-stddev       adaptive: the noise on the unclipped count (it takes a share of z: keep it > z / 2)
  ledger-id          the privacy ledger of this training ("": a new one per run)
  local-steps, lr    each client's training: gradient steps and learning rate
"""

from __future__ import annotations

import os
import uuid

from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from clipd.client import Adaptive, Client, Privacy
from clipd.client.flower import ClipdStrategy
from clipd_flower_app import task

app = ServerApp()

# The defaults of the run config, as in pyproject.toml (flwr run passes that file's values; a ServerApp run
# some other way, e.g. by flwr.simulation.run_simulation, gets these).
DEFAULTS = {
    "clipd-target": "127.0.0.1:50051", "num-server-rounds": 3, "clients-per-round": 4, "clipping-norm": 1.0,
    "noise-multiplier": 0.5, "delta": 1e-5, "max-epsilon": 0.0, "adaptive-clipping": False, "count-stddev": 0.5,
    "ledger-id": "",
    "local-steps": 5, "lr": 0.05,
}
last_run: dict = {}  # the last run's Result and strategy, for whoever runs the app in-process


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = {**DEFAULTS, **context.run_config}
    m = int(config["clients-per-round"])
    adaptive = bool(config["adaptive-clipping"])
    privacy = Privacy(
        ledger_id=str(config["ledger-id"]) or f"flower-{uuid.uuid4().hex[:12]}",
        delta=float(config["delta"]),
        noise_multiplier=float(config["noise-multiplier"]),
        max_epsilon=float(config["max-epsilon"]),
        adaptive=Adaptive(initial_bound=float(config["clipping-norm"]), count_stddev=float(config["count-stddev"]))
        if adaptive else None,
    )
    with Client(str(config["clipd-target"]), token=os.environ.get("CLIPD_ADMIN_TOKEN") or None) as client:
        strategy = ClipdStrategy(
            # FedAvg samples max(int(nodes * fraction), min_*_nodes): with a tiny fraction, exactly m nodes
            FedAvg(fraction_train=1e-9, min_train_nodes=m, min_available_nodes=m,
                   fraction_evaluate=1e-9, min_evaluate_nodes=m),
            client,
            clipping_norm=None if adaptive else float(config["clipping-norm"]),
            num_sampled_clients=m,
            privacy=privacy,
        )
        train_config = ConfigRecord({"local-steps": int(config["local-steps"]), "lr": float(config["lr"])})
        initial = ArrayRecord({name: Array(value) for name, value in task.initial_model().items()})
        result = strategy.start(grid=grid, initial_arrays=initial,
                                num_rounds=int(config["num-server-rounds"]), train_config=train_config)
    last_run.update(result=result, strategy=strategy)
    if strategy.releases:
        release = strategy.releases[-1]
        print(f"clipd: {len(strategy.releases)} releases on ledger {privacy.ledger_id}:"
              f" epsilon {release.ledger_epsilon:.4g} at delta {privacy.delta:g},"
              f" noise stddev of the mean {release.noise_stddev / m:.4g}")
    if strategy.stopped:
        print(f"clipd: training stopped early: {strategy.stopped}")
