"""Logits of a zoo or Keras-JSON model with Keras on TensorFlow, for evaluation
(crowdtrain.assimilator.evaluate)."""

import numpy as np

from crowdtrain.core import zoo_keras
from crowdtrain.core.tensors import Params

# Each job's model, built once per process.
_models: dict[int, zoo_keras.KerasModel] = {}


def logits(job_id: int, model_config: dict, params: Params, x: np.ndarray, batch_size: int) -> np.ndarray:
    """The model's logits for `x` with `params` set, computed `batch_size` examples at a time."""
    model = _models.get(job_id)
    if model is None:
        model = _models[job_id] = zoo_keras.build_model(model_config)
    model.set_params(params)
    return np.concatenate(
        [np.asarray(model.model(x[i : i + batch_size], training=False)) for i in range(0, len(x), batch_size)]
    )
