"""Validation of W_s on the job's server-side validation split, with the job's framework.

A zoo job is evaluated with its own framework when this parameter server has it installed, else
with another that ports the model (W_s has one canonical layout). The loss and accuracy are
computed here from the model's logits, the same arithmetic for every framework.
"""

import numpy as np
import torch
from torch import nn

from crowdtrain.core import frameworks, zoo, zoo_keras
from crowdtrain.core.tensors import Params

# Each job's model, built once per process and framework.
_torch_models: dict[int, nn.Module] = {}
_keras_models: dict[int, zoo_keras.KerasModel] = {}


def _torch_logits(job_id: int, model_config: dict, params: Params, x: np.ndarray, batch_size: int) -> np.ndarray:
    model = _torch_models.get(job_id)
    if model is None:
        model = _torch_models[job_id] = zoo.build_model(
            model_config["name"], model_config["input_shape"], model_config["num_classes"], **model_config["options"]
        )
    zoo.load_numpy_state(model, params)
    model.eval()
    with torch.inference_mode():
        return np.concatenate(
            [model(torch.from_numpy(x[i : i + batch_size])).numpy() for i in range(0, len(x), batch_size)]
        )


def _tensorflow_logits(job_id: int, model_config: dict, params: Params, x: np.ndarray, batch_size: int) -> np.ndarray:
    model = _keras_models.get(job_id)
    if model is None:
        model = _keras_models[job_id] = zoo_keras.build_model(model_config)
    model.set_params(params)
    return np.concatenate(
        [np.asarray(model.model(x[i : i + batch_size], training=False)) for i in range(0, len(x), batch_size)]
    )


_LOGITS = {"pytorch": _torch_logits, "tensorflow": _tensorflow_logits}


def evaluation_framework(model_config: dict) -> str:
    found = frameworks.pick(model_config, frameworks.installed())
    if found is None:
        raise RuntimeError(
            f"no installed framework runs model {model_config['name']!r} "
            f"(needs one of {frameworks.able_to_run(model_config)}; install crowdtrain[tensorflow])"
        )
    return found


def evaluate(
    job_id: int,
    model_config: dict,
    params: Params,
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int = 1024,
    framework: str | None = None,
) -> tuple[float, float]:
    """Return (mean cross-entropy loss, accuracy) of `params` on (x, y)."""
    logits = _LOGITS[framework or evaluation_framework(model_config)](job_id, model_config, params, x, batch_size)
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = -log_probs[np.arange(len(y)), y].mean()
    return float(loss), float((logits.argmax(axis=1) == y).mean())
