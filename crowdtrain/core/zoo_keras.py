"""Keras ports of the zoo models, and Keras-JSON models loaded in safe mode.

TensorFlow is an optional extra: it is imported only when a function here is called.

Ported zoo models read and write W_s in the canonical layout, the PyTorch zoo's `state_dict`
names and shapes (crowdtrain/zoo.py), so PyTorch and TensorFlow clients train the same job:
- Linear weight (out, in)       <-> Dense kernel (in, out)
- Conv1d weight (out, in, k)    <-> Conv1D kernel (k, in, out)
- inputs stay as the dataset gives them, (length,) or (channels, length) for cnn1d: the Keras
  model reshapes/permutes them to channels-last itself, so the global max over the length and the
  head see the same features as in PyTorch.
A Keras-JSON model's canonical names are its weights' Keras paths ("dense/kernel").
"""

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from crowdtrain.core.frameworks import KERAS_MODEL, ZOO_PORTS
from crowdtrain.core.tensors import Params


def keras_module() -> Any:
    """Keras 3 on the TensorFlow backend (the trainer uses tf.GradientTape). Keras has no type
    information: the module, its models and variables are `Any` to mypy."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up banners are noise in our logs
    import keras

    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(f"Keras runs on {keras.backend.backend()!r}; crowdtrain needs KERAS_BACKEND=tensorflow")
    return keras


# (canonical name, Keras variable, axes permutation between the two layouts or None)
Slot = tuple[str, Any, tuple[int, ...] | None]
# to canonical, from canonical: PyTorch weight <-> Keras kernel
_KERNEL_LAYOUT = {"dense": (1, 0), "conv1d": (2, 1, 0)}


@dataclass
class KerasModel:
    """A Keras model with the mapping between its weights and the job's canonical names."""

    model: Any  # keras.Model
    slots: list[Slot] = field(default_factory=list)

    def get_params(self) -> Params:
        out = {}
        for name, var, perm in self.slots:
            value = np.asarray(var.numpy())
            out[name] = np.ascontiguousarray(value.transpose(perm) if perm else value)
        return out

    def set_params(self, params: Params) -> None:
        expected = {name for name, _, _ in self.slots}
        if set(params) != expected:
            raise ValueError(
                f"parameter names differ: missing {sorted(expected - set(params))}, "
                f"unexpected {sorted(set(params) - expected)}"
            )
        for name, var, perm in self.slots:
            value = np.asarray(params[name])
            var.assign(value.transpose(perm) if perm else value)


def _map_layer(slots: list[Slot], prefix: str, layer: Any, kind: str) -> None:
    slots.append((f"{prefix}.weight", layer.kernel, _KERNEL_LAYOUT[kind]))
    slots.append((f"{prefix}.bias", layer.bias, None))


def build_mlp(input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (256, 256)) -> KerasModel:
    keras = keras_module()
    inputs = keras.Input(tuple(input_shape))
    x = keras.layers.Flatten()(inputs)  # row-major like torch.flatten: no reordering needed
    dense = []
    for h in hidden:
        dense.append(keras.layers.Dense(h, activation="relu"))
        x = dense[-1](x)
    dense.append(keras.layers.Dense(num_classes))
    model = keras.Model(inputs, dense[-1](x))
    slots: list[Slot] = []
    for i, layer in enumerate(dense):  # nn.Sequential indices: Flatten, then (Linear, ReLU) pairs
        _map_layer(slots, f"net.{1 + 2 * i}", layer, "dense")
    return KerasModel(model, slots)


def build_cnn1d(
    input_shape: Sequence[int], num_classes: int, channels: int = 32, kernel_size: int = 5, layers: int = 3
) -> KerasModel:
    keras = keras_module()
    inputs = keras.Input(tuple(input_shape))
    if len(input_shape) == 1:
        x = keras.layers.Reshape((int(input_shape[0]), 1))(inputs)
    else:
        x = keras.layers.Permute((2, 1))(inputs)  # (channels, length) -> channels-last
    convs, index = [], 0
    for i in range(layers):
        # Explicit zero padding reproduces Conv1d(padding=k//2) also for even kernels, where
        # Keras "same" would give a different output length.
        x = keras.layers.ZeroPadding1D(kernel_size // 2)(x)
        convs.append((index, keras.layers.Conv1D(channels, kernel_size, activation="relu")))
        x = convs[-1][1](x)
        index += 2
        if i < layers - 1:
            x = keras.layers.MaxPooling1D(2)(x)
            index += 1
    x = keras.layers.GlobalMaxPooling1D()(x)
    head = keras.layers.Dense(num_classes)
    model = keras.Model(inputs, head(x))
    slots: list[Slot] = []
    for idx, layer in convs:
        _map_layer(slots, f"features.{idx}", layer, "conv1d")
    _map_layer(slots, "head", head, "dense")
    return KerasModel(model, slots)


_BUILDERS: dict[str, Callable[..., KerasModel]] = {"mlp": build_mlp, "cnn1d": build_cnn1d}
assert set(_BUILDERS) == ZOO_PORTS["tensorflow"], "crowdtrain.core.frameworks.ZOO_PORTS is out of date"


def load_keras_json(config: dict[str, Any] | str) -> Any:
    """A Keras model from its JSON config, in safe mode: Lambda layers and other code are refused.

    Raises ValueError with Keras's reason for anything it cannot or will not build.
    """
    keras = keras_module()
    try:
        cfg = json.loads(config) if isinstance(config, str) else config
        model = keras.saving.deserialize_keras_object(cfg, safe_mode=True)
    except Exception as exc:
        raise ValueError(f"model.keras: not a loadable Keras model in safe mode: {exc}") from None
    if not isinstance(model, keras.Model):
        raise ValueError(f"model.keras: describes a {type(model).__name__}, not a Keras model")
    return model


def build_keras_json(config: dict[str, Any] | str, input_shape: Sequence[int], num_classes: int) -> KerasModel:
    """Load a Keras-JSON model and check that it maps the dataset's inputs to `num_classes` logits."""
    model = load_keras_json(config)
    try:
        out = model(np.zeros((1, *input_shape), dtype=np.float32))
    except Exception as exc:
        raise ValueError(f"model.keras: does not accept inputs shaped {tuple(input_shape)}: {exc}") from None
    if tuple(out.shape) != (1, num_classes):
        raise ValueError(f"model.keras: outputs shape {tuple(out.shape)[1:]}, the dataset needs ({num_classes},)")
    paths = [v.path for v in model.weights]
    if len(set(paths)) != len(paths):
        raise ValueError("model.keras: two weights share a path; give the layers unique names")
    return KerasModel(model, [(v.path, v, None) for v in model.weights])


def build_model(model_config: dict[str, Any], seed: int | None = None) -> KerasModel:
    """The Keras model of a job's model config (zoo port or Keras JSON); `seed` makes its init reproducible."""
    keras = keras_module()
    if seed is not None:
        keras.utils.set_random_seed(seed)
    name, shape, classes = model_config["name"], model_config["input_shape"], model_config["num_classes"]
    if name == KERAS_MODEL:
        return build_keras_json(model_config["keras"], shape, classes)
    if name not in _BUILDERS:
        raise ValueError(f"model {name!r} has no Keras port; TensorFlow runs {sorted(_BUILDERS)} and Keras JSON")
    try:
        return _BUILDERS[name](list(shape), int(classes), **model_config.get("options", {}))
    except TypeError as exc:
        raise ValueError(f"bad options for model {name!r}: {exc}") from exc
