"""DP-SGD in JAX where clipd clips, noises and accounts: the same MLP and data as dpsgd_torch.py.

    pip install '.[server,examples]'
    python examples/dpsgd_jax.py                        # starts an embedded clipd server

Each step: Poisson-sample the training set, compute each sampled example's gradient
(``jax.vmap(jax.grad(loss))``, jitted on a batch padded to a multiple of 64 so that a handful of
programs serve every sample size), stream them to clipd (``DpSgd.step``: clipped to C, summed,
noised with stddev z * C, divided by q * n, recorded on the ledger), and take an SGD step with
momentum with what comes back. The same report, plot and JSON as the PyTorch example.
"""

from __future__ import annotations

import collections
import sys
import time

import dpsgd_common as common  # examples/dpsgd_common.py: data, flags, server, report
import jax
import jax.numpy as jnp
import numpy as np

from clipd.client import Client, FailedPreconditionError

PAD = 64  # per-example gradients are computed on batches padded to a multiple of this


def init_params(key: jax.Array) -> dict[str, jax.Array]:
    """64 -> 32 (tanh) -> 10, PyTorch's layout and its nn.Linear initialisation (U(+-1/sqrt(fan_in)))."""
    shapes = {"fc1.weight": (32, 64), "fc1.bias": (32,), "fc2.weight": (10, 32), "fc2.bias": (10,)}
    fan_in = {"fc1.weight": 64, "fc1.bias": 64, "fc2.weight": 32, "fc2.bias": 32}
    keys = jax.random.split(key, len(shapes))
    return {name: jax.random.uniform(k, shape, jnp.float32, -1.0, 1.0) / np.sqrt(fan_in[name])
            for k, (name, shape) in zip(keys, shapes.items())}


def logits(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    hidden = jnp.tanh(x @ params["fc1.weight"].T + params["fc1.bias"])
    return hidden @ params["fc2.weight"].T + params["fc2.bias"]


def loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    """Cross-entropy of one example."""
    return -jax.nn.log_softmax(logits(params, x))[y]


_per_example_padded = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))


def per_example_gradients(params, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """``{name: (B, *shape)}``: the gradient of each example's loss alone (as numpy arrays)."""
    b = len(y)
    padded = max(PAD, -(-b // PAD) * PAD)
    xs = np.zeros((padded, x.shape[1]), np.float32)
    ys = np.zeros(padded, np.int32)
    xs[:b], ys[:b] = x, y
    grads = _per_example_padded(params, xs, ys)
    return {name: np.asarray(g)[:b] for name, g in grads.items()}


@jax.jit
def sgd_momentum(params, velocity, gradient, lr, momentum):
    """PyTorch's SGD with momentum: v <- m v + g; p <- p - lr v."""
    velocity = jax.tree.map(lambda v, g: momentum * v + g, velocity, gradient)
    return jax.tree.map(lambda p, v: p - lr * v, params, velocity), velocity


def accuracy(params, x: np.ndarray, y: np.ndarray) -> float:
    return float(jnp.mean(jnp.argmax(logits(params, x), axis=1) == y))


def main(argv: list[str] | None = None) -> dict:
    args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
    data = common.load_digits()
    n = len(data.y_train)
    params = init_params(jax.random.key(args.seed))
    velocity = jax.tree.map(jnp.zeros_like, params)
    layers = {name: tuple(p.shape) for name, p in params.items()}
    rng = common.sampling_rng(args)
    per_epoch = common.steps_per_epoch(args, n)
    history, phases = [], collections.defaultdict(list)
    with common.clipd_server(args) as (target, admin), Client(target, token=args.token) as client, \
            common.open_dpsgd(args, client, layers, n, admin) as dp:
        for epoch in range(1, args.epochs + 1):
            started, bar = time.perf_counter(), common.Progress(epoch, args.epochs, per_epoch, args.quiet)
            refused, order = False, rng.permutation(n)  # (the epoch's batches under a correlated stream)
            for done in range(1, per_epoch + 1):
                batch = common.batch(args, n, dp, rng, order, done)
                try:
                    step = dp.step(per_example_gradients(params, data.x_train[batch], data.y_train[batch]))
                except FailedPreconditionError as e:  # --max-epsilon: the ledger refused this step
                    print(f"\nstopping: {e.details}", file=sys.stderr)
                    refused = True
                    break
                params, velocity = sgd_momentum(params, velocity, step.gradient, args.lr, args.momentum)
                for phase, seconds in step.seconds.items():
                    phases[phase].append(seconds)
                bar.update(done, dp.epsilon)
                if common.stop(args, dp):
                    break
            bar.close()
            history.append(common.end_epoch(args, dp, admin, epoch, accuracy(params, data.x_test, data.y_test), started))
            if refused or common.stop(args, dp) or done < per_epoch:  # refused: no epoch after it
                break
    return common.finish(args, "jax", history, dp, phases)


if __name__ == "__main__":
    main(sys.argv[1:])
