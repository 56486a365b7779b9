"""A peer's state on the wire: model parameters plus optimizer state, as one safetensors file."""

import numpy as np
import torch

from crowdtrain.core.tensors import Params, decode, encode
from crowdtrain.core.zoo import load_numpy_state, state_to_numpy

_OPT = "__opt__"


def make_optimizer(model: torch.nn.Module, spec: dict) -> torch.optim.Optimizer:
    if spec["optimizer"] == "adam":
        return torch.optim.Adam(model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"])
    return torch.optim.SGD(
        model.parameters(), lr=spec["lr"], momentum=spec["momentum"], weight_decay=spec["weight_decay"]
    )


def encode_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> bytes:
    tensors: Params = state_to_numpy(model)
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            if value is not None:
                tensors[f"{_OPT}/{index}/{key}"] = torch.as_tensor(value).detach().cpu().numpy().copy()
    return encode(tensors)


def load_state(model: torch.nn.Module, opt: torch.optim.Optimizer, blob: bytes) -> None:
    tensors = decode(blob)
    load_numpy_state(model, {k: v for k, v in tensors.items() if not k.startswith("__")})
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith(_OPT + "/"):
            _, index, key = name.split("/", 2)
            state.setdefault(int(index), {})[key] = torch.from_numpy(np.array(value, copy=True))
    sd = opt.state_dict()
    sd["state"] = state
    opt.load_state_dict(sd)
