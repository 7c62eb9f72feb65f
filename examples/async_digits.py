"""Federated learning that never waits for the slowest client: synchronous rounds against a buffered stream.

N simulated clients hold shares of scikit-learn's digits and train a softmax regression locally; how long a
client takes is heavy-tailed (lognormal, sigma 1 by default), as devices are. Both runs go through clipd, with
the same clip, the same noise multiplier and the same participation limit per client (so the same epsilon):

- **synchronous**: rounds of ``m`` clients (``clipd.client.rounds.PrivateRounds``, the logic of the Flower
  strategy and the NVFlare aggregator): each round waits for its slowest client, then releases the noised mean;
- **asynchronous**: ``m`` clients train at once, each submitting to a buffered stream with the version it
  trained from as soon as it is done, then training again from the newest version; the stream releases a new
  version every ``m`` contributions (staleness weights ``(1 + tau)^-0.5``).

It reports the wall time each needs to reach the synchronous run's final accuracy, and ends with the line::

    async: clients=<n> releases=<r> accuracy=<a> epsilon=<e> wall_s=<t> sync_accuracy=<a2> sync_epsilon=<e2> sync_wall_s=<t2>

(``wall_s``: until the asynchronous run first reaches ``sync_accuracy``; ``accuracy``: where it stopped). Each
run's clock starts once its first aggregation has warmed up (the first round's, the stream's first buffer: their
programs compiled, once a server for a layout), as a training run of hours would hardly see it.

Run: ``python examples/async_digits.py --clients 60`` (an embedded server unless ``--target``, with
``--token`` its admin token).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import logging
import pathlib
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from dpsgd_common import load_digits  # noqa: E402

from clipd.client import Buffer, Client, ClipdError, FailedPreconditionError, Privacy  # noqa: E402
from clipd.client.rounds import PrivateRounds  # noqa: E402

CLASSES, FEATURES = 10, 64


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=60, help="simulated clients, each a share of the training set")
    p.add_argument("--per-round", type=int, default=10, help="m: clients per synchronous round, clients training"
                                                              " at once asynchronously, and the stream's K")
    p.add_argument("--rounds", type=int, default=30, help="synchronous rounds")
    p.add_argument("--median-seconds", type=float, default=0.1, help="a client's median training time")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the training times (>= 1: heavy)")
    p.add_argument("--noise-multiplier", type=float, default=1.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--max-participations", type=int, default=10, help="k: contributions per client, in either run")
    p.add_argument("--server-learning-rate", type=float, default=1.0)
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--local-learning-rate", type=float, default=0.5)
    p.add_argument("--async-cap", type=float, default=3.0, help="the asynchronous run stops at this many times the"
                                                                " synchronous run's wall time if it never gets there")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default=None, help="HOST:PORT of a clipd server with an admin token (default: start"
                                                  " one in this process)")
    p.add_argument("--token", default=None, help="the server's admin token (with --target)")
    return p.parse_args(argv)


# The model: softmax regression, trained locally by gradient descent -----------------------------------------
def initial_model() -> dict[str, np.ndarray]:
    return {"w": np.zeros((FEATURES, CLASSES), np.float32), "b": np.zeros(CLASSES, np.float32)}


def accuracy(model: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.argmax(x @ model["w"] + model["b"], axis=1) == y))


def local_update(model: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, steps: int, lr: float
                 ) -> dict[str, np.ndarray]:
    """``trained - model`` after ``steps`` full-batch gradient steps on the client's data (float64 inside)."""
    w, b = model["w"].astype(np.float64), model["b"].astype(np.float64)
    onehot = np.eye(CLASSES)[y]
    for _ in range(steps):
        logits = x @ w + b
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        grad = (p - onehot) / len(y)
        w -= lr * (x.T @ grad)
        b -= lr * grad.sum(axis=0)
    return {"w": (w - model["w"]).astype(np.float32), "b": (b - model["b"]).astype(np.float32)}


class Clients:
    """The simulated clients: their data shares and their heavy-tailed training times."""

    def __init__(self, args: argparse.Namespace) -> None:
        data = load_digits()
        self.data = data
        order = np.random.default_rng(args.seed).permutation(len(data.y_train))
        self.shares = np.array_split(order, args.clients)
        self.rng = np.random.default_rng(args.seed + 1)
        self.lock = threading.Lock()
        self.args = args

    def train(self, client: int, model: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A client's update, after its (simulated) training time has passed."""
        with self.lock:
            seconds = self.args.median_seconds * float(self.rng.lognormal(0.0, self.args.sigma))
        share = self.shares[client]
        update = local_update(model, self.data.x_train[share], self.data.y_train[share], self.args.local_steps,
                              self.args.local_learning_rate)
        time.sleep(seconds)
        return update


def wait_open(client: Client, aggregation_id: str, timeout: float = 300.0) -> None:
    """Until the aggregation has warmed up (its programs compiled: once a server, for a layout): each run's
    clock starts after it, as a long training run's would hardly see it."""
    from clipd.v1 import clipd_pb2 as pb

    deadline = time.monotonic() + timeout
    while client.get_aggregation(aggregation_id).state == pb.Aggregation.WARMING_UP and time.monotonic() < deadline:
        time.sleep(0.05)


def privacy(args: argparse.Namespace, name: str) -> Privacy:
    return Privacy(f"{name}-{uuid.uuid4().hex[:8]}", 1e-5, noise_multiplier=args.noise_multiplier,
                   max_participations=args.max_participations, min_separation=1, release_mean=True)


# Synchronous rounds ----------------------------------------------------------------------------------------
def synchronous(args: argparse.Namespace, client: Client, clients: Clients) -> dict:
    """Rounds of m clients drawn among those under their limit; each waits for its slowest."""
    rounds = PrivateRounds(client, clipping_norm=args.clip, num_sampled_clients=args.per_round,
                           privacy=privacy(args, "sync"), log=logging.getLogger("sync"), name="sync")
    model, taken = initial_model(), np.zeros(args.clients, np.int64)
    rng = np.random.default_rng(args.seed + 2)
    started, history = time.perf_counter(), []
    with concurrent.futures.ThreadPoolExecutor(args.per_round) as pool:
        for number in range(1, args.rounds + 1):
            allowed = np.flatnonzero(taken < args.max_participations)
            if len(allowed) < args.per_round:
                break
            chosen = rng.choice(allowed, args.per_round, replace=False)
            taken[chosen] += 1
            if not rounds.open(number, model):
                break
            if number == 1:  # the clock starts once the first round is warm
                assert rounds.open_round is not None
                wait_open(client, rounds.open_round.aggregation_id)
                started = time.perf_counter()
            for site, update in zip(chosen, pool.map(lambda c, m=model: clients.train(int(c), m), chosen)):
                rounds.submit(f"client-{site}", update)  # (this round's updates, once the slowest is in)
            new, _ = rounds.release(as_update=True)
            if new is None:
                break
            model = {k: (model[k] + args.server_learning_rate * new[k]).astype(np.float32) for k in model}
            history.append((time.perf_counter() - started, accuracy(model, clients.data.x_test,
                                                                    clients.data.y_test)))
    epsilon = client.ledger(rounds.privacy.ledger_id).epsilon
    return {"accuracy": history[-1][1], "wall_s": history[-1][0], "epsilon": epsilon, "releases": len(history),
            "history": history}


# The asynchronous stream ------------------------------------------------------------------------------------
def asynchronous(args: argparse.Namespace, client: Client, clients: Clients, goal: float, cap_s: float,
                 target: str, token: str) -> dict:
    """m clients training at once on a buffered stream of K = m (each on a connection of its own to ``target``);
    stops at ``goal`` accuracy, or after ``cap_s`` seconds."""
    p = privacy(args, "async")
    stream = client.create_stream({"w": (FEATURES, CLASSES), "b": (CLASSES,)}, l2_norm_clip=args.clip, privacy=p,
                                  buffer=Buffer(size=args.per_round, staleness_exponent=0.5, max_staleness=50,
                                                max_wait=2.0))
    state = {"model": initial_model(), "version": 0, "stop": False}
    lock = threading.Lock()
    idle = list(range(args.clients))
    rng = np.random.default_rng(args.seed + 3)
    history: list[tuple[float, float]] = []
    reached: list[float] = []
    wait_open(client, f"{stream}.v1")  # the clock starts once the first buffer is warm
    started = time.perf_counter()

    def worker() -> None:
        with Client(target, token=token, retry_timeout=30.0) as mine:
            while True:
                with lock:
                    if state["stop"] or not idle:
                        return
                    site = idle.pop(int(rng.integers(len(idle))))
                    model, version = state["model"], state["version"]
                update = clients.train(site, model)
                try:
                    mine.submit_to_stream(stream, update, trained_from=version, client_id=f"client-{site}")
                except FailedPreconditionError as e:
                    if "allows at most" in e.details or "stopped" in e.details:
                        continue  # this client is done (its limit), or the stream
                with lock:
                    idle.append(site)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.per_round)]
    for t in threads:
        t.start()
    try:
        while not reached and time.perf_counter() - started < cap_s:
            version = state["version"]
            try:  # the releases as they come, a few seconds at a time (the clients may all be done: their k)
                for release in client.watch_releases(stream, after=version, timeout=5.0):
                    with lock:
                        model = {k: (state["model"][k] + args.server_learning_rate * release.sums[k]
                                     ).astype(np.float32) for k in state["model"]}
                        state["model"], state["version"] = model, release.version
                    now = time.perf_counter() - started
                    history.append((now, accuracy(model, clients.data.x_test, clients.data.y_test)))
                    if history[-1][1] >= goal:
                        reached.append(now)
                    if reached or now > cap_s:
                        break
            except ClipdError as e:
                if getattr(e.code, "name", "") != "DEADLINE_EXCEEDED":
                    raise
            if not any(t.is_alive() for t in threads) and state["version"] == version:
                break  # every client is done and no buffer is left to release
    finally:
        with lock:
            state["stop"] = True
        client.stop_stream(stream)
        for t in threads:
            t.join(60)
    epsilon = client.ledger(p.ledger_id).epsilon
    return {"accuracy": history[-1][1] if history else 0.0, "wall_s": reached[0] if reached else float("inf"),
            "epsilon": epsilon, "releases": len(history), "history": history}


@contextlib.contextmanager
def clipd_server(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """``(target, admin token)``: the server of ``--target``, or one started here (auth on: the streams count
    client identities)."""
    if args.target is not None:
        yield args.target, args.token
        return
    from clipd.server.app import create_server
    from clipd.server.settings import Settings

    logging.getLogger("absl").setLevel(logging.ERROR)
    token = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="clipd-async-") as data_dir:
        server, port = create_server(Settings(host="127.0.0.1", grpc_port=0, admin_port=-1, data_dir=data_dir,
                                              admin_token=token, log_level="warning"))
        try:
            print(f"started an embedded clipd server on 127.0.0.1:{port} (durable store in {data_dir})",
                  file=sys.stderr)
            yield f"127.0.0.1:{port}", token
        finally:
            server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    clients = Clients(args)
    with clipd_server(args) as (target, token), Client(target, token=token, retry_timeout=60.0) as client:
        sync = synchronous(args, client, clients)
        print(f"synchronous: {sync['releases']} rounds of {args.per_round}, accuracy {sync['accuracy']:.4f},"
              f" epsilon {sync['epsilon']:.4g}, {sync['wall_s']:.2f} s")
        run = asynchronous(args, client, clients, sync["accuracy"], args.async_cap * sync["wall_s"], target, token)
        print(f"asynchronous: {run['releases']} releases of {args.per_round}, accuracy {run['accuracy']:.4f},"
              f" epsilon {run['epsilon']:.4g}, {run['wall_s']:.2f} s to {sync['accuracy']:.4f}"
              f" ({run['wall_s'] / sync['wall_s']:.2f}x the synchronous run's time)")
    print(f"async: clients={args.clients} releases={run['releases']} accuracy={run['accuracy']:.4f}"
          f" epsilon={run['epsilon']:.6g} wall_s={run['wall_s']:.3f} sync_accuracy={sync['accuracy']:.4f}"
          f" sync_epsilon={sync['epsilon']:.6g} sync_wall_s={sync['wall_s']:.3f}")
    return {"sync": sync, "async": run}


if __name__ == "__main__":
    main()
