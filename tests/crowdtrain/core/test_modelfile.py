"""The exported model says what it is in its safetensors header, its tensors untouched, and the manual's
lines (docs/operator/jobs.md) load it in PyTorch and in Keras as they are written."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from crowdtrain import __version__
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.modelfile import model_metadata, read_metadata, with_metadata
from crowdtrain.core.tensors import TensorFormatError, decode, encode
from crowdtrain.core.zoo import build_model, state_to_numpy
from tests.conftest import EXAMPLE_SPEC, ROOT


def _example_model() -> tuple[dict, dict[str, np.ndarray], dict[str, str]]:
    """The example job's model config, parameters and exported metadata (mnist1d: 40 values, 10 classes)."""
    spec = load_job_spec(EXAMPLE_SPEC)
    config = {
        "name": spec.model.name,
        "framework": spec.framework,
        "input_shape": [40],
        "num_classes": 10,
        "options": spec.model.options,
    }
    params = state_to_numpy(build_model(config["name"], [40], 10, seed=3, **config["options"]))
    metadata = model_metadata(7, spec.name, spec.model_dump(mode="json"), config, 42, 0.9125)
    return config, params, metadata


def test_the_metadata_says_what_the_model_is() -> None:
    config, _, metadata = _example_model()
    assert metadata["format"] == "crowdtrain-model/1" and metadata["crowdtrain_version"] == __version__
    assert (metadata["job_id"], metadata["job_name"], metadata["framework"]) == ("7", "mnist1d-cnn", "pytorch")
    assert (metadata["model_name"], metadata["param_version"], metadata["val_accuracy"]) == ("cnn1d", "42", "0.9125")
    assert json.loads(metadata["model_config"]) == config
    assert json.loads(metadata["job_spec"])["stop"]["target_accuracy"] == 0.9
    assert model_metadata(7, "j", {}, config, 0, None)["val_accuracy"] == ""


def test_the_header_changes_and_the_tensors_stay_byte_for_byte() -> None:
    _, params, metadata = _example_model()
    blob = encode(params)
    exported = with_metadata(blob, metadata)
    header_size = int.from_bytes(exported[:8], "little")
    assert header_size % 8 == 0
    assert exported[8 + header_size :] == blob[8 + int.from_bytes(blob[:8], "little") :]
    assert read_metadata(exported) == metadata and read_metadata(blob) == {}
    for name, value in decode(exported).items():
        assert value.dtype == params[name].dtype
        np.testing.assert_array_equal(value, params[name])
    assert with_metadata(exported, {"a": "b"}) == with_metadata(blob, {"a": "b"})  # replaced, not merged


@pytest.mark.parametrize(
    "blob", [b"", b"\xff" * 8, (4).to_bytes(8, "little") + b"nope", (2).to_bytes(8, "little") + b"[]"]
)
def test_a_file_that_is_not_safetensors_is_refused(blob: bytes) -> None:
    with pytest.raises(TensorFormatError):
        read_metadata(blob)


def _manual_blocks() -> list[str]:
    """The Python blocks of the jobs page's "The exported model" section, PyTorch's first."""
    page = (ROOT / "docs" / "operator" / "jobs.md").read_text()
    section = page.split("\n## The exported model\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, np.ndarray]:
    """The example model exported as `model.safetensors` in the working directory, as the manual has it."""
    _, params, metadata = _example_model()
    (tmp_path / "model.safetensors").write_bytes(with_metadata(encode(params), metadata))
    monkeypatch.chdir(tmp_path)
    with safe_open("model.safetensors", "np") as f:
        assert f.metadata() == metadata
    return params


def test_the_manual_loads_the_exported_model_in_pytorch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(_manual_blocks()) == 2
    params = _export(tmp_path, monkeypatch)
    namespace: dict = {}
    exec(_manual_blocks()[0], namespace)
    loaded = state_to_numpy(namespace["model"])
    assert loaded.keys() == params.keys()
    for name, value in loaded.items():
        np.testing.assert_array_equal(value, params[name])
    assert namespace["meta"]["val_accuracy"] == "0.9125"


def test_the_manual_loads_the_exported_model_in_keras(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorflow")
    params = _export(tmp_path, monkeypatch)
    namespace: dict = {}
    exec(_manual_blocks()[1], namespace)
    loaded = namespace["model"].get_params()
    assert loaded.keys() == params.keys()
    for name, value in loaded.items():
        np.testing.assert_allclose(value, params[name], rtol=0, atol=0)
    x = np.random.default_rng(0).normal(size=(4, 40)).astype(np.float32)
    assert namespace["keras_model"].predict(x, verbose=0).shape == (4, 10)
