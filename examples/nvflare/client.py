"""A site of the example: trains the global model on its shard of the digits and sends back its update.

NVFlare runs this script in each simulated site (``flare.receive`` / ``flare.send``). The site's update leaves as
a DIFF (the recipe's ``params_transfer_type``): clipd clips it as one contribution of the site.
"""

from __future__ import annotations

import argparse
import json

import nvflare.client as flare
import torch
from digits_net import DigitsNet, accuracy, digits, site_shard
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sites", type=int, required=True)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--report", default="", help="a JSONL file: site-1 appends the accuracy of each global model")
    args = p.parse_args()
    flare.init()
    site = flare.get_site_name()  # site-1, site-2, ...
    x, y = site_shard(int(site.rsplit("-", 1)[1]), args.sites)
    _, _, x_test, y_test = digits()
    model = DigitsNet()
    generator = torch.Generator().manual_seed(hash(site) % (1 << 31))
    while flare.is_running():
        received = flare.receive()
        model.load_state_dict({k: torch.as_tensor(v) for k, v in received.params.items()})
        if args.report and site == "site-1":  # the global model as released by the last round (public test split)
            with open(args.report, "a") as report:
                report.write(json.dumps({"round": received.current_round, "accuracy": accuracy(model, x_test, y_test)})
                             + "\n")
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        xs, ys = torch.from_numpy(x), torch.from_numpy(y)
        steps = 0
        for _ in range(args.local_epochs):
            for batch in torch.randperm(len(ys), generator=generator).split(args.batch_size):
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(xs[batch]), ys[batch]).backward()
                optimizer.step()
                steps += 1
        flare.send(flare.FLModel(params={k: v.detach().cpu() for k, v in model.state_dict().items()},
                                 params_type=flare.ParamsType.FULL, meta={"NUM_STEPS_CURRENT_ROUND": steps}))


if __name__ == "__main__":
    main()
