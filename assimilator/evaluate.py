"""Validation of W_s on the job's server-side validation split."""

import numpy as np
import torch

from crowdtrain.tensors import Params
from crowdtrain.zoo import build_model, load_numpy_state

_models: dict[int, torch.nn.Module] = {}


def evaluate(job_id: int, model_config: dict, params: Params, x: np.ndarray, y: np.ndarray,
             batch_size: int = 1024) -> tuple[float, float]:
    """Return (mean cross-entropy loss, accuracy) of `params` on (x, y)."""
    model = _models.get(job_id)
    if model is None:
        model = _models[job_id] = build_model(model_config["name"], model_config["input_shape"],
                                              model_config["num_classes"], **model_config["options"])
    load_numpy_state(model, params)
    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(x), batch_size):
            xb = torch.from_numpy(x[start:start + batch_size])
            yb = torch.from_numpy(y[start:start + batch_size])
            logits = model(xb)
            loss_sum += float(torch.nn.functional.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(1) == yb).sum())
    return loss_sum / len(x), correct / len(x)
