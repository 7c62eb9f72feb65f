"""DP-SGD in PyTorch where clipd clips, noises and accounts: a small MLP on scikit-learn's digits.

    pip install 'torch==2.13.0' '.[server,examples]'    # the CPU build of torch on these machines
    python examples/dpsgd_torch.py                      # starts an embedded clipd server

Each step:

1. Poisson-sample the training set (each image joins with probability q = batch_size / n);
2. compute each sampled example's gradient (``torch.func``: vmap of grad);
3. stream them to clipd (``DpSgd.step``), which clips each to C, sums them, adds Gaussian noise of
   stddev z * C, divides by q * n and records the step on the run's privacy ledger;
4. put what comes back into ``p.grad`` and take an SGD step.

After each epoch it prints the test accuracy, the ledger's epsilon and the fraction of examples
clipped per layer (noised, read from the admin API); at the end a plot (accuracy against epsilon,
clip fractions) and a JSON history go to ``--out``.
"""

from __future__ import annotations

import collections
import sys
import time

import dpsgd_common as common  # examples/dpsgd_common.py: data, flags, server, report
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from clipd.client import Client, FailedPreconditionError


class Mlp(nn.Module):
    """64 pixels -> 32 tanh units -> 10 classes (2,410 parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def per_example_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name: (B, *param.shape)}``: the gradient of each example's loss alone."""
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(params, x_i, y_i):
        logits = functional_call(model, params, (x_i.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, y_i.unsqueeze(0))

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main(argv: list[str] | None = None) -> dict:
    args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
    torch.manual_seed(args.seed)
    data = common.load_digits()
    x_train, y_train = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    x_test, y_test = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    n = len(y_train)
    model = Mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    layers = {name: tuple(p.shape) for name, p in model.named_parameters()}
    rng = common.sampling_rng(args)
    per_epoch = common.steps_per_epoch(args, n)
    history, phases = [], collections.defaultdict(list)
    with common.clipd_server(args) as (target, admin), Client(target, token=args.token) as client, \
            common.open_dpsgd(args, client, layers, n, admin) as dp:
        for epoch in range(1, args.epochs + 1):
            started, bar = time.perf_counter(), common.Progress(epoch, args.epochs, per_epoch, args.quiet)
            refused, order = False, rng.permutation(n)  # (the epoch's batches under a correlated stream)
            for done in range(1, per_epoch + 1):
                batch = torch.from_numpy(common.batch(args, n, dp, rng, order, done))
                try:
                    step = dp.step(per_example_gradients(model, x_train[batch], y_train[batch]))
                except FailedPreconditionError as e:  # --max-epsilon: the ledger refused this step
                    print(f"\nstopping: {e.details}", file=sys.stderr)
                    refused = True
                    break
                for name, p in model.named_parameters():
                    p.grad = torch.from_numpy(step.gradient[name])  # the noised mean of clipped gradients
                optimizer.step()
                for phase, seconds in step.seconds.items():
                    phases[phase].append(seconds)
                bar.update(done, dp.epsilon)
                if common.stop(args, dp):
                    break
            bar.close()
            history.append(common.end_epoch(args, dp, admin, epoch, accuracy(model, x_test, y_test), started))
            if refused or common.stop(args, dp) or done < per_epoch:  # refused: no epoch after it
                break
    return common.finish(args, "torch", history, dp, phases)


if __name__ == "__main__":
    main(sys.argv[1:])
