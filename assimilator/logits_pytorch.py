"""Logits of a zoo model with PyTorch, for evaluation (crowdtrain.assimilator.evaluate)."""

from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from torch import nn

from crowdtrain.core import zoo
from crowdtrain.core.experts import EXPERT_PREFIX
from crowdtrain.core.tensors import Params
from crowdtrain.core.zoo_experts import MixtureTrunk, local_experts

# Each job's model, built once per process.
_models: dict[int, nn.Module] = {}


def logits(job_id: int, model_config: dict, params: Params, x: np.ndarray, batch_size: int) -> np.ndarray:
    """The model's logits for `x` with `params` loaded, computed `batch_size` examples at a time."""
    model = _models.get(job_id)
    if model is None:
        model = _models[job_id] = zoo.build_model(
            model_config["name"], model_config["input_shape"], model_config["num_classes"], **model_config["options"]
        )
    if isinstance(model, MixtureTrunk):  # mode moe: the trunk, and its experts from `params` (expert/UID/NAME)
        zoo.load_numpy_state(model, {k: v for k, v in params.items() if not k.startswith(EXPERT_PREFIX)})
        forward: Callable[[torch.Tensor], torch.Tensor] = partial(model, experts=local_experts(model.layout, params))
    else:
        zoo.load_numpy_state(model, params)
        forward = model
    model.eval()
    with torch.inference_mode():
        return np.concatenate(
            [forward(torch.from_numpy(x[i : i + batch_size])).numpy() for i in range(0, len(x), batch_size)]
        )
