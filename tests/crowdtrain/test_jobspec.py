import subprocess
import sys

import pytest
from pydantic import ValidationError

from crowdtrain.jobspec import JobSpec, load_job_spec
from tests.conftest import EXAMPLE_SPEC


def test_the_example_spec_is_valid() -> None:
    spec = load_job_spec(EXAMPLE_SPEC)
    assert spec.stop.target_accuracy == 0.90 and spec.dataset.source == "builtin:mnist1d"


@pytest.mark.parametrize(("patch", "field"), [
    ({"dataset": {"source": "http://example.com/data"}}, "dataset.source"),
    ({"assimilation": {"alpha": 1.0}}, "assimilation.alpha"),
    ({"assimilation": {"schedule": "cosine"}}, "assimilation.schedule"),
    ({"training": {"lr": -1}}, "training.lr"),
    ({"surprise": 1}, "surprise"),
])
def test_invalid_specs_name_the_bad_field(patch: dict, field: str) -> None:
    data = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json") | patch
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate(data)
    assert field.split(".")[-1] in str(err.value)


def test_job_submit_refuses_a_bad_spec_with_exit_code_2(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: {name: cnn1d}\ndataset: {source: builtin:mnist1d}\nstop: {target_accuracy: 7}\n")
    result = subprocess.run([sys.executable, "-m", "crowdtrain", "job", "submit", str(bad), "--server",
                             "http://127.0.0.1:9"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "target_accuracy" in result.stderr


@pytest.mark.parametrize(("model", "framework", "message"), [
    ({"name": "resnet"}, "tensorflow", "model 'resnet' has no tensorflow port"),
    ({"name": "keras", "keras": {"class_name": "Sequential"}}, "pytorch", "needs framework: tensorflow"),
    ({"name": "keras"}, "tensorflow", "given exactly when model.name is 'keras'"),
    ({"name": "cnn1d", "keras": {"class_name": "Sequential"}}, "tensorflow", "given exactly when"),
    ({"name": "cnn1d"}, "jax", "framework"),
])
def test_the_framework_must_run_the_model(model: dict, framework: str, message: str) -> None:
    data = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json") | {"model": model, "framework": framework}
    with pytest.raises(ValidationError, match=message):
        JobSpec.model_validate(data)


def test_keras_file_is_read_relative_to_the_spec() -> None:
    spec = load_job_spec(EXAMPLE_SPEC.parent / "mnist1d-keras.yaml")
    assert spec.framework == "tensorflow" and spec.model.name == "keras"
    assert spec.model.keras["class_name"] == "Sequential"
    assert load_job_spec(EXAMPLE_SPEC.parent / "mnist1d-cnn-tensorflow.yaml").framework == "tensorflow"
