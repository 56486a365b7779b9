"""Keras ports of the zoo: the canonical layout round-trips exactly and gives PyTorch's logits;
Keras-JSON models load in safe mode only."""

import json

import numpy as np
import pytest
import torch

pytest.importorskip("tensorflow")

from crowdtrain.core import zoo, zoo_keras  # noqa: E402

CASES = [
    ("mlp", [40], {}),
    ("mlp", [3, 8], {"hidden": [16, 12]}),
    ("cnn1d", [40], {}),
    ("cnn1d", [3, 41], {"channels": 6, "kernel_size": 4, "layers": 2}),  # channels-first input, even kernel
]


@pytest.mark.parametrize(("name", "shape", "options"), CASES)
def test_canonical_weights_round_trip_and_give_pytorchs_logits(name: str, shape: list[int], options: dict) -> None:
    torch_model = zoo.build_model(name, shape, 10, seed=1, **options)
    canonical = zoo.state_to_numpy(torch_model)
    keras_model = zoo_keras.build_model({"name": name, "input_shape": shape, "num_classes": 10, "options": options})
    keras_model.set_params(canonical)

    back = keras_model.get_params()
    assert back.keys() == canonical.keys()
    for k, v in canonical.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v), k

    x = np.random.default_rng(0).normal(size=(8, *shape)).astype(np.float32)
    expected = torch_model.eval()(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(np.asarray(keras_model.model(x)), expected, rtol=1e-5, atol=1e-5)


def test_resnet_has_no_keras_port() -> None:
    with pytest.raises(ValueError, match="no Keras port"):
        zoo_keras.build_model({"name": "resnet", "input_shape": [3, 32, 32], "num_classes": 10, "options": {}})


def test_wrong_parameter_names_are_refused() -> None:
    keras_model = zoo_keras.build_model({"name": "mlp", "input_shape": [4], "num_classes": 2, "options": {}})
    params = keras_model.get_params()
    params["extra"] = params.pop("net.1.bias")
    with pytest.raises(ValueError, match="missing \\['net.1.bias'\\], unexpected \\['extra'\\]"):
        keras_model.set_params(params)


def small_keras_json(extra_layer: dict | None = None) -> str:
    keras = zoo_keras.keras_module()
    layers = [keras.Input((40,)), keras.layers.Dense(16, activation="relu", name="hidden")]
    if extra_layer == "lambda":
        layers.append(keras.layers.Lambda(lambda t: t * 2.0, name="double"))
    layers.append(keras.layers.Dense(10, name="logits"))
    return keras.Sequential(layers).to_json()


def test_keras_json_model_builds_with_its_weight_paths_as_canonical_names() -> None:
    built = zoo_keras.build_keras_json(small_keras_json(), [40], 10)
    assert {k: v.shape for k, v in built.get_params().items()} == {
        "hidden/kernel": (40, 16),
        "hidden/bias": (16,),
        "logits/kernel": (16, 10),
        "logits/bias": (10,),
    }


def test_keras_json_with_a_lambda_layer_is_refused() -> None:
    text = small_keras_json("lambda")
    assert '"Lambda"' in text
    with pytest.raises(ValueError, match="safe mode.*Lambda"):
        zoo_keras.build_keras_json(text, [40], 10)


def test_keras_json_with_the_wrong_output_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"outputs shape \(10,\), the dataset needs \(3,\)"):
        zoo_keras.build_keras_json(json.loads(small_keras_json()), [40], 3)


def test_seed_makes_the_initial_weights_reproducible() -> None:
    config = {"name": "keras", "keras": small_keras_json(), "input_shape": [40], "num_classes": 10}
    a, b = (zoo_keras.build_model(config, seed=5).get_params() for _ in range(2))
    c = zoo_keras.build_model(config, seed=6).get_params()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["hidden/kernel"], c["hidden/kernel"])


def test_keras_json_naming_a_function_outside_keras_is_refused() -> None:
    # An activation that would resolve to os.system if Keras imported whatever module a config names.
    evil = {
        "module": "keras",
        "class_name": "Sequential",
        "config": {
            "name": "s",
            "layers": [
                {
                    "module": "keras.layers",
                    "class_name": "Dense",
                    "config": {
                        "units": 2,
                        "activation": {
                            "module": "os",
                            "class_name": "function",
                            "config": "system",
                            "registered_name": "function",
                        },
                    },
                }
            ],
        },
    }
    with pytest.raises(ValueError, match="safe mode"):
        zoo_keras.load_keras_json(evil)
