"""The ClientApp: trains the global model on this node's data and sends the new model back.

Nothing here knows about clipd or DP: the ServerApp's strategy clips and noises the updates.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clipd_flower_app import task

app = ClientApp()


def _model(msg: Message) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in msg.content["arrays"].items()}


@app.train()
def train(msg: Message, context: Context) -> Message:
    x, y = task.load_data(int(context.node_config["partition-id"]))
    config = msg.content["config"]
    model = task.train(_model(msg), x, y, steps=int(config.get("local-steps", 5)), lr=float(config.get("lr", 0.05)))
    content = RecordDict({
        "arrays": ArrayRecord({name: Array(value) for name, value in model.items()}),
        "metrics": MetricRecord({"num-examples": len(y), "train-loss": task.loss(model, x, y)}),
    })
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    x, y = task.load_data(int(context.node_config["partition-id"]))
    metrics = MetricRecord({"num-examples": len(y), "eval-loss": task.loss(_model(msg), x, y)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
