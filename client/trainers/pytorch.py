"""Local training with PyTorch: start from the snapshot (or a checkpoint), train on the shard, return W_c."""

import time

import numpy as np
import torch

from crowdtrain.client.cpu_kernels import guard_cpu_training
from crowdtrain.client.trainers import Checkpoint, TrainControl, TrainResult, examples_in, local_steps
from crowdtrain.core.tensors import Params
from crowdtrain.core.zoo import build_model, load_numpy_state, state_to_numpy

# Checkpoint tensor names beside the model's own (which never start with "__").
_OPT = "__opt__"
_ORDER = "__order__"
_RNG = "__rng__"


def make_optimizer(model: torch.nn.Module, t: dict) -> torch.optim.Optimizer:
    if t["optimizer"] == "adam":
        return torch.optim.Adam(model.parameters(), lr=t["lr"], weight_decay=t["weight_decay"])
    return torch.optim.SGD(model.parameters(), lr=t["lr"], momentum=t["momentum"], weight_decay=t["weight_decay"])


def optimizer_tensors(opt: torch.optim.Optimizer) -> Params:
    """The optimizer's per-parameter state (Adam moments and step, SGD momentum) as named arrays."""
    out: Params = {}
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            out[f"{_OPT}/{index}/{key}"] = torch.as_tensor(value).detach().cpu().numpy().copy()
    return out


def load_optimizer(opt: torch.optim.Optimizer, tensors: Params) -> None:
    sd = opt.state_dict()
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith(_OPT + "/"):
            _, index, key = name.split("/", 2)
            state.setdefault(int(index), {})[key] = torch.from_numpy(np.array(value, copy=True))
    sd["state"] = state
    opt.load_state_dict(sd)


def train(
    recipe: dict,
    params: Params,
    x: np.ndarray,
    y: np.ndarray,
    device: str = "cpu",
    control: TrainControl | None = None,
    checkpoint: Checkpoint | None = None,
    local_fraction: float = 1.0,
    optimizer_state: Params | None = None,
) -> TrainResult:
    """Run `local_fraction` of `training.local_epochs` passes over (x, y) from `params` (in steps,
    rounded up); see crowdtrain.client.trainers for the contract. The optimizer starts from
    `optimizer_state` (a previous result's `optimizer_state`, same model and optimizer) when given,
    else from zero (a resumed checkpoint holds its own); the result carries its state at the end."""
    start = time.monotonic()
    guard_cpu_training(device)
    control = control or TrainControl()
    m, t = recipe["model"], recipe["training"]
    model = build_model(m["name"], m["input_shape"], m["num_classes"], **m["options"])
    opt = make_optimizer(model, t)
    gen = torch.Generator().manual_seed(int(recipe["seed"]))
    first_epoch, first_batch, loss_sum, seen, order = 0, 0, 0.0, 0, None
    resumed = checkpoint.resumed if checkpoint is not None else None
    if resumed is not None:
        tensors, progress = resumed
        load_numpy_state(model, {k: v for k, v in tensors.items() if not k.startswith("__")})
        load_optimizer(opt, tensors)
        gen.set_state(torch.from_numpy(np.array(tensors[_RNG], copy=True)))
        order = torch.from_numpy(np.array(tensors[_ORDER], copy=True))
        first_epoch, first_batch = progress["epoch"], progress["batch_start"]
        loss_sum, seen = progress["loss_sum"], progress["seen"]
    else:
        load_numpy_state(model, params)
        if optimizer_state is not None:
            load_optimizer(opt, optimizer_state)
    model.to(device).train()
    # Moving the model after loading keeps the optimizer state on the parameters' device.
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step":
                st[k] = v.to(device)
    xt, yt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y)).long()
    bs = t["batch_size"]
    steps = local_steps(len(xt), bs, t["local_epochs"], local_fraction)
    per_epoch = -(-len(xt) // bs)
    for epoch in range(first_epoch, -(-steps // per_epoch)):
        if order is None:
            order = torch.randperm(len(xt), generator=gen)
            loss_sum, seen = 0.0, 0
        # The step count is positional, so a resumed run stops where an uninterrupted one would.
        for i in range(first_batch, min(len(order), (steps - epoch * per_epoch) * bs), bs):
            control.between_batches()
            if checkpoint is not None and i > first_batch and checkpoint.due():
                _save(checkpoint, model, opt, gen, order, epoch, i, loss_sum, seen)
            idx = order[i : i + bs]
            xb, yb = xt[idx].to(device), yt[idx].to(device)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(idx)
            seen += len(idx)
        order, first_batch = None, 0
    model.to("cpu")
    return TrainResult(
        state_to_numpy(model),
        loss_sum / max(seen, 1),
        examples_in(steps, len(xt), bs),
        time.monotonic() - start,
        optimizer_tensors(opt),
    )


def _save(
    checkpoint: Checkpoint,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    gen: torch.Generator,
    order: torch.Tensor,
    epoch: int,
    batch_start: int,
    loss_sum: float,
    seen: int,
) -> None:
    tensors = {
        **state_to_numpy(model),
        **optimizer_tensors(opt),
        _ORDER: order.numpy().copy(),
        _RNG: gen.get_state().numpy().copy(),
    }
    checkpoint.save(tensors, {"epoch": epoch, "batch_start": batch_start, "loss_sum": loss_sum, "seen": seen})
