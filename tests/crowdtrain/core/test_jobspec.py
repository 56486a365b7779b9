import subprocess
import sys

import pytest
from pydantic import ValidationError

from crowdtrain.assimilator.rules import BUILDERS, make_rule
from crowdtrain.core.assimilationspec import DEFAULT_ASSIMILATION, RULE_SPECS, assimilation_of, effective_rule
from crowdtrain.core.dedlocspec import DedlocSpec
from crowdtrain.core.jobspec import JobSpec, load_job_spec
from tests.conftest import EXAMPLE_SPEC, ROOT


def test_the_example_spec_is_valid() -> None:
    spec = load_job_spec(EXAMPLE_SPEC)
    assert spec.stop.target_accuracy == 0.90 and spec.dataset.source == "builtin:mnist1d"


@pytest.mark.parametrize("example", ["mnist1d-cnn.yaml", "mnist1d-cnn-tensorflow.yaml", "mnist1d-keras.yaml"])
def test_the_example_jobs_merge_with_the_default_configuration(example: str) -> None:
    assert load_job_spec(ROOT / "examples" / example).assimilation == assimilation_of()


def test_a_section_without_a_rule_gets_the_default_configuration_and_keeps_what_it_sets() -> None:
    default = assimilation_of()
    assert default.model_dump(include=set(DEFAULT_ASSIMILATION)) == DEFAULT_ASSIMILATION
    assert assimilation_of(dict(server_lr=0.5)).model_dump(include=set(DEFAULT_ASSIMILATION)) == (
        DEFAULT_ASSIMILATION | {"server_lr": 0.5}
    )
    # A rule named: that rule with the fields' own defaults, not the default configuration's.
    named = assimilation_of(dict(rule="delta"))
    assert (named.staleness_weight, named.step_control) == ("constant", "none")
    assert assimilation_of(dict(rule="vc-asgd")).alpha == 0.6


@pytest.mark.parametrize(("fields", "rule"), [({"alpha": 0.7}, "vc-asgd"), ({"buffer_size": 8}, "fedbuff")])
def test_another_rule_s_own_field_without_a_rule_is_refused_naming_the_rule_to_add(fields: dict, rule: str) -> None:
    with pytest.raises(ValidationError, match=f"assimilation.{next(iter(fields))} is a {rule} setting.*rule: {rule}"):
        assimilation_of(fields)


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ({"rule": "delta", "alpha": 0.7}, "assimilation.alpha is an option of rule vc-asgd, not of rule delta"),
        ({"rule": "fedbuff", "schedule": "epoch"}, "assimilation.schedule is an option of rule vc-asgd"),
        ({"rule": "vc-asgd", "server_lr": 0.5}, "assimilation.server_lr is an option of rule delta and fedbuff"),
        (
            {"rule": "delta", "combiner": "median"},
            "assimilation.combiner is an option of rule fedbuff, not of rule delta",
        ),
        ({"rule": "fedbuff", "staleness_weight": "gain"}, "Input should be 'constant', 'polynomial' or 'hinge'"),
        ({"rule": "delta", "nonsense": 1}, "Extra inputs are not permitted"),
    ],
)
def test_a_rule_s_section_holds_its_own_options_and_the_policy_s_and_refuses_the_rest(
    section: dict, words: str
) -> None:
    with pytest.raises(ValidationError, match=words):
        assimilation_of(section)
    with pytest.raises(ValidationError, match=words):  # and so does a whole spec
        JobSpec.model_validate(load_job_spec(EXAMPLE_SPEC).model_dump(mode="json") | {"assimilation": section})


@pytest.mark.parametrize("rule", list(RULE_SPECS))
def test_each_rule_s_section_is_its_own_model_and_dumps_only_its_options(rule: str) -> None:
    """What a job stores is its rule's section: read back, it is the same model with the same values."""
    section = assimilation_of({"rule": rule, "clip_norm": 2.0})
    assert type(section) is RULE_SPECS[rule]
    stored = section.model_dump(mode="json")
    assert set(stored) == set(RULE_SPECS[rule].model_fields)
    assert assimilation_of(stored) == section
    assert isinstance(make_rule(stored), type(make_rule({"rule": rule})))
    assert type(section) in BUILDERS, "every rule of the spec has a builder"


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"dataset": {"source": "http://example.com/data"}}, "dataset.source"),
        ({"assimilation": {"rule": "vc-asgd", "alpha": 1.0}}, "assimilation.alpha"),
        ({"assimilation": {"rule": "vc-asgd", "schedule": "cosine"}}, "assimilation.schedule"),
        ({"training": {"lr": -1}}, "training.lr"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_invalid_specs_name_the_bad_field(patch: dict, field: str) -> None:
    data = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json") | patch
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate(data)
    assert field.split(".")[-1] in str(err.value)


def test_job_submit_refuses_a_bad_spec_with_exit_code_2(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: {name: cnn1d}\ndataset: {source: builtin:mnist1d}\nstop: {target_accuracy: 7}\n")
    result = subprocess.run(
        [sys.executable, "-m", "crowdtrain", "job", "submit", str(bad), "--server", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "target_accuracy" in result.stderr


@pytest.mark.parametrize(
    ("model", "framework", "message"),
    [
        ({"name": "resnet"}, "tensorflow", "model 'resnet' has no tensorflow port"),
        ({"name": "keras", "keras": {"class_name": "Sequential"}}, "pytorch", "needs framework: tensorflow"),
        ({"name": "keras"}, "tensorflow", "given exactly when model.name is 'keras'"),
        ({"name": "cnn1d", "keras": {"class_name": "Sequential"}}, "tensorflow", "given exactly when"),
        ({"name": "cnn1d"}, "jax", "framework"),
    ],
)
def test_the_framework_must_run_the_model(model: dict, framework: str, message: str) -> None:
    data = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json") | {"model": model, "framework": framework}
    with pytest.raises(ValidationError, match=message):
        JobSpec.model_validate(data)


def test_keras_file_is_read_relative_to_the_spec() -> None:
    spec = load_job_spec(EXAMPLE_SPEC.parent / "mnist1d-keras.yaml")
    assert spec.framework == "tensorflow" and spec.model.name == "keras"
    assert spec.model.keras["class_name"] == "Sequential"
    assert load_job_spec(EXAMPLE_SPEC.parent / "mnist1d-cnn-tensorflow.yaml").framework == "tensorflow"


def _with_model(model: dict) -> dict:
    return load_job_spec(EXAMPLE_SPEC).model_dump(mode="json") | {"model": model}


@pytest.mark.parametrize(
    ("model", "words"),
    [
        (
            {"name": "cnn1d", "options": {"seed": 3}},
            "model.options.seed: not an option of 'cnn1d': the scheduler sets it from the job's top-level seed",
        ),
        ({"name": "mlp", "options": {"name": "x"}}, "model.options.name: not an option of 'mlp'"),
        ({"name": "cnn1d", "options": {"input_shape": [40]}}, "model.options.input_shape: not an option"),
        ({"name": "cnn1d", "options": {"num_classes": 3}}, "model.options.num_classes: not an option"),
        (
            {"name": "cnn1d", "options": {"wings": 2}},
            "model.options.wings: not an option of 'cnn1d'; it takes channels, kernel_size, layers",
        ),
        (
            {"name": "cnn1d", "options": {"channels": 0}},
            "model.options.channels: Input should be greater than or equal",
        ),
        ({"name": "cnn1d", "options": {"layers": "3"}}, "model.options.layers: Input should be a valid integer"),
        ({"name": "mlp", "options": {"hidden": [64, -1]}}, "model.options.hidden.1: Input should be greater than"),
        ({"name": "resnet", "options": {"width": 10**9}}, "model.options.width: Input should be less than"),
        ({"name": "resnet", "options": {"blocks": 1.5}}, "model.options.blocks: Input should be a valid integer"),
    ],
)
def test_model_options_the_builder_cannot_take_are_refused(model: dict, words: str) -> None:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate(_with_model(model))
    assert words in str(err.value)


def test_a_relative_dataset_path_is_refused_by_the_spec(tmp_path) -> None:
    data = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
    data["dataset"]["source"] = "npz:data/x.npz"
    with pytest.raises(ValidationError, match="'data/x.npz' is a relative path, but the scheduler reads"):
        JobSpec.model_validate(data)


def test_a_spec_file_resolves_a_relative_dataset_path_and_says_so(tmp_path) -> None:
    (tmp_path / "jobs").mkdir()
    spec = tmp_path / "jobs" / "job.yaml"
    spec.write_text(EXAMPLE_SPEC.read_text().replace("builtin:mnist1d", "npz:../data/x.npz"))
    notes: list[str] = []
    assert load_job_spec(spec, notes).dataset.source == f"npz:{tmp_path / 'data' / 'x.npz'}"
    assert notes == [
        f"dataset.source: 'npz:../data/x.npz' is read relative to the spec file, as {tmp_path / 'data' / 'x.npz'}"
    ]


BOMB = "\n".join(
    ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    + [f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi", strict=True)]
    + ["name: x"]
)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (BOMB, "YAML aliases expand to more than 500000 nodes"),
        ("name: [x\nmodel: {", "not valid YAML: expected ',' or ']', but got ':' at line 2, column 6"),
        ("name: x\n" + "#" * (1024 * 1024), "larger than the limit of 1048576 bytes"),
        ("[" * 5000, "nested more than 100 deep"),
        ("- 1\n- 2\n", "a job spec is a mapping, got list"),
    ],
)
def test_a_spec_file_that_cannot_be_read_gives_one_line(tmp_path, text: str, words: str) -> None:
    from crowdtrain.core.specfile import SpecFileError

    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SpecFileError) as err:
        load_job_spec(path)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_aliases_within_the_budget_still_load(tmp_path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(
        EXAMPLE_SPEC.read_text().replace(
            "options: {channels: 32, kernel_size: 5, layers: 3}",
            "options: &cnn {channels: 32, kernel_size: 5, layers: 3}",
        )
        + "x-unused: [*cnn, *cnn]\n"
    )
    data = __import__("crowdtrain.core.specfile", fromlist=["load_yaml"]).load_yaml(path)
    assert data["x-unused"] == [data["model"]["options"]] * 2


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (BOMB, "YAML aliases expand to more than 500000 nodes"),
        ("name: [x\nmodel: {", "not valid YAML"),
    ],
)
def test_job_submit_refuses_an_unreadable_spec_with_one_line_and_exit_code_2(tmp_path, text: str, words: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "crowdtrain", "job", "submit", str(bad), "--server", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("compression", ["none", "float16", "bfloat16"])
def test_a_dedloc_job_names_its_all_reduce_compression(compression: str) -> None:
    section = DedlocSpec.model_validate({"target_batch_size": 64, "compression": compression})
    assert section.compression == compression
    assert DedlocSpec.model_validate({"target_batch_size": 64}).compression == "none"  # exact by default


@pytest.mark.parametrize("compression", ["fp16", "int8", "", None])
def test_an_unknown_compression_is_refused_with_the_formats_it_could_be(compression: str | None) -> None:
    with pytest.raises(ValidationError) as err:
        DedlocSpec.model_validate({"target_batch_size": 64, "compression": compression})
    message = str(err.value)
    assert "compression" in message and all(f"'{c}'" in message for c in ("none", "float16", "bfloat16"))


MOE_SPEC = ROOT / "examples" / "clusters-moe.yaml"


def test_the_moe_example_spec_is_valid_and_its_model_is_shaped_by_its_experts_section() -> None:
    spec = load_job_spec(MOE_SPEC)
    assert spec.mode == "moe" and spec.experts is not None
    config = spec.configure_model([8], 10)
    assert config["name"] == "moe" and config["options"]["layout"] == spec.experts.model_dump(mode="json")


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"experts": None}, "mode 'moe' needs an 'experts' section"),
        ({"model": {"name": "mlp"}}, "model.name is 'moe', not 'mlp'"),
        ({"framework": "tensorflow"}, "mode 'moe' trainers run PyTorch"),
        ({"mode": "vc-asgd"}, "an 'experts' section is only allowed with mode 'moe'"),
        ({"mode": "vc-asgd", "experts": None}, "model 'moe' is the trunk of a mixture-of-experts model"),
        ({"model": {"name": "moe", "options": {"layout": {}}}}, "the scheduler sets it from the job's experts"),
        ({"experts": {"k": 5, "k_min": 6}}, "k_min (6) is above k (5)"),
        ({"experts": {"grid": [2, 2], "k": 5}}, "k (5) is above the 4 experts of a layer"),
        ({"experts": {"in_flight": 0}}, "experts.in_flight"),
    ],
)
def test_a_moe_spec_refuses_sections_that_do_not_fit_the_mode(patch: dict, message: str) -> None:
    data = load_job_spec(MOE_SPEC).model_dump(mode="json") | patch
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate(data)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("assimilation", "line"),
    [
        (
            {},
            "delta (server_lr 1.0, staleness_weight polynomial, staleness_a 0.5, step_control loss, step_floor 0.0625)",
        ),
        ({"rule": "vc-asgd"}, "vc-asgd (schedule constant, alpha 0.6)"),
        ({"rule": "vc-asgd", "schedule": "epoch", "max_staleness": 3}, "vc-asgd (schedule epoch, max_staleness 3)"),
        (
            {"rule": "fedbuff", "combiner": "trimmed-mean", "outer_optimizer": "nesterov", "clip_norm": 2.0},
            "fedbuff (server_lr 1.0, staleness_weight constant, buffer_size 4, combiner trimmed-mean, "
            "trim_fraction 0.2, outer_optimizer nesterov, outer_momentum 0.9, step_control none, clip_norm 2.0)",
        ),
    ],
)
def test_the_effective_rule_names_every_option_the_rule_reads_defaults_included(assimilation: dict, line: str) -> None:
    assert effective_rule(assimilation_of(assimilation)) == line
