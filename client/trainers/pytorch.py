"""Local training with PyTorch: start from the snapshot, train on the shard, return W_c."""

import time

import numpy as np
import torch

from client.trainers import Checkpoint, TrainControl, TrainResult
from crowdtrain.tensors import Params
from crowdtrain.zoo import build_model, load_numpy_state, state_to_numpy


def train(recipe: dict, params: Params, x: np.ndarray, y: np.ndarray, device: str = "cpu",
          *, control: TrainControl, checkpoint: Checkpoint | None = None) -> TrainResult:
    """Run `training.local_epochs` passes over (x, y) from `params`; see client.trainers for the contract."""
    start = time.monotonic()
    m, t = recipe["model"], recipe["training"]
    model = build_model(m["name"], m["input_shape"], m["num_classes"], **m["options"])
    load_numpy_state(model, params)
    model.to(device).train()
    if t["optimizer"] == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=t["lr"], weight_decay=t["weight_decay"])
    else:
        opt = torch.optim.SGD(model.parameters(), lr=t["lr"], momentum=t["momentum"], weight_decay=t["weight_decay"])
    gen = torch.Generator().manual_seed(int(recipe["seed"]))
    xt, yt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y)).long()
    bs, loss_sum, seen = t["batch_size"], 0.0, 0
    for _ in range(t["local_epochs"]):
        order = torch.randperm(len(xt), generator=gen)
        loss_sum, seen = 0.0, 0
        for i in range(0, len(order), bs):
            control.between_batches()
            idx = order[i:i + bs]
            xb, yb = xt[idx].to(device), yt[idx].to(device)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(idx)
            seen += len(idx)
    model.to("cpu")
    return TrainResult(state_to_numpy(model), loss_sum / max(seen, 1), len(xt) * t["local_epochs"],
                       time.monotonic() - start)
